"""Where a compaction stops (`memory.recall.compaction.verbatim_start`), over random verbatim
turns: seqs with gaps (messages off the branch between them), tool results anywhere (a window
may open on one), any room, a protected seq anywhere, the new messages' seq past a gap. It never
fails, lands on a turn or at the end, compacts nothing from the protected seq on, and never
starts the kept turns on a tool result whose call it could keep."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from memory.recall.compaction import verbatim_start
from memory.recall.working_context import Item


@st.composite
def turns(draw: st.DrawFn) -> tuple[list[Item], list[int], int, int, int]:
    roles = draw(st.lists(st.sampled_from(["user", "assistant", "tool"]), min_size=1, max_size=12))
    seqs, seq = [], 0
    for _ in roles:
        seq += draw(st.integers(min_value=1, max_value=3))  # a gap: messages off the branch
        seqs.append(seq)
    costs = draw(st.lists(st.integers(1, 50), min_size=len(roles), max_size=len(roles)))
    items = [
        Item(node_id=s, seq=s, role=r, name=None, message={"role": r}, tokens=c)
        for s, r, c in zip(seqs, roles, costs, strict=True)
    ]
    end = seq + draw(st.integers(min_value=1, max_value=3))
    room = draw(st.integers(0, sum(costs)))
    protect = draw(st.integers(0, end + 1))
    return items, costs, end, room, protect


@given(turns())
def test_a_compaction_stops_on_a_turn_and_keeps_what_is_protected(
    drawn: tuple[list[Item], list[int], int, int, int],
) -> None:
    items, costs, end, room, protect = drawn
    found = verbatim_start(items, costs, room=room, protect=protect, end=end)
    assert found == end or found in {item.seq for item in items}
    # Nothing from the protected seq on is compacted.
    assert not [item for item in items if protect <= item.seq < found]
    # The kept turns open on a tool result only when no call before it could be kept.
    kept = [item for item in items if item.seq >= found]
    if kept and kept[0].role == "tool" and kept[0] is not items[0]:
        assert all(item.role == "tool" for item in items[: items.index(kept[0])]) or (
            kept[0].seq >= protect
        )
