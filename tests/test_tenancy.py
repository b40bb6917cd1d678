"""The relay's tenancy rules as pure functions (`gateway.openai.tenancy`): where a path points,
which paths are open, which body fields name objects and which answers make them."""

from gateway.openai.tenancy import Target, is_open, produced, references, target


def test_a_path_points_into_an_owned_collection() -> None:
    assert target("files") == Target("files", None, ())
    assert target("files/file-1/content") == Target("files", "file-1", ("content",))
    assert target("fine_tuning/jobs/ftjob-1/events") == Target(
        "fine_tuning/jobs", "ftjob-1", ("events",)
    )
    assert target("vector_stores/vs_1/files/file-2") == Target(
        "vector_stores", "vs_1", ("files", "file-2")
    )
    assert target("fine_tuning/checkpoints/x") is None
    assert target("chat/completions") is None
    assert target("filesystem") is None


def test_open_paths_match_whole_segments() -> None:
    opened = ("audio", "responses/input_tokens")
    assert is_open("audio/speech", opened)
    assert is_open("responses/input_tokens", opened)
    assert not is_open("audiobooks", opened)
    assert not is_open("responses/resp_1", opened)


def test_references_are_named_fields_outside_metadata_and_citations() -> None:
    body = {
        "input_file_id": "file-in",
        "tools": [{"type": "file_search", "vector_store_ids": ["vs_1", "vs_2"]}],
        "messages": [{"content": [{"type": "file", "file": {"file_id": "file-part"}}]}],
        "conversation": {"id": "conv_1"},
        "metadata": {"file_id": "just a label"},
        "output": [{"content": [{"annotations": [{"file_id": "cfile_cited"}]}]}],
        "container": {"type": "auto"},
    }
    assert references(body) == {
        "file-in": "input_file_id",
        "vs_1": "vector_store_ids",
        "vs_2": "vector_store_ids",
        "file-part": "file_id",
        "conv_1": "conversation",
    }
    assert references("file_id") == {}


def test_objects_made_for_a_tenant_are_named_by_the_answer() -> None:
    batch = {"id": "batch_1", "output_file_id": "file-out", "error_file_id": None}
    assert produced(batch) == {"file-out"}
    upload = {"id": "upload_1", "object": "upload", "file": {"id": "file-up", "object": "file"}}
    assert produced(upload) == {"file-up"}
    assert produced({"id": "ftjob-1", "result_files": ["file-r"]}) == {"file-r"}
    assert produced({"id": "vsf", "object": "vector_store.file"}) == set()
