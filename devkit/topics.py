"""The subjects of the synthetic conversations (`devkit.synthetic`): words, facts, phrasings.

`TOPICS` holds seven `Topic`s (travel booking, database migration, birthday planning, bug
triage, budget planning, hiring, home renovation), each with its word lists, its fact generators
(ticket ids, booking references, flight numbers, amounts, percentages, ISO dates, names), its
tool calls and the user's and the assistant's sentence templates. A template's fields:
``{name}`` is a slot drawn once per topic run; ``{name!}`` also plants the value as a fact.
Fields not in a topic's generators come from its word lists (not facts).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# --- vocabulary ---------------------------------------------------------------------------------

FIRST_NAMES = (
    "Priya",
    "Marcus",
    "Elena",
    "Tomasz",
    "Aiko",
    "Fatima",
    "Jonas",
    "Chloe",
    "Rahul",
    "Ingrid",
    "Mateo",
    "Yusuf",
    "Hannah",
    "Kenji",
    "Olivia",
    "Dmitri",
    "Amara",
    "Lucas",
    "Sofia",
    "Wei",
)
LAST_NAMES = (
    "Raman",
    "Okafor",
    "Lindqvist",
    "Kowalski",
    "Tanaka",
    "Haddad",
    "Becker",
    "Dubois",
    "Mehta",
    "Solberg",
    "Alvarez",
    "Demir",
    "Fischer",
    "Sato",
    "Brennan",
    "Volkov",
    "Mensah",
    "Moreau",
    "Rossi",
    "Zhang",
)
CITIES = (
    "Lisbon",
    "Osaka",
    "Vancouver",
    "Nairobi",
    "Reykjavik",
    "Montreal",
    "Seville",
    "Kyoto",
    "Auckland",
    "Prague",
    "Singapore",
    "Marrakech",
    "Copenhagen",
    "Buenos Aires",
)
AIRLINES = ("LH", "BA", "AF", "KL", "UA", "NH", "TP", "SK", "AC", "QF")
MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def _amount(rng: random.Random) -> str:
    return f"${rng.randint(3, 240) * 200:,}"


def _small_amount(rng: random.Random) -> str:
    return f"${rng.randint(12, 900)}"


def _iso_date(rng: random.Random) -> str:
    return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _spoken_date(rng: random.Random) -> str:
    return f"{rng.choice(MONTHS)} {rng.randint(1, 28)}"


def _ticket(prefix: str) -> Callable[[random.Random], str]:
    return lambda rng: f"{prefix}-{rng.randint(1000, 9999)}"


def _reference(rng: random.Random) -> str:
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
    return (
        rng.choice(letters)
        + str(rng.randint(2, 9))
        + "".join(rng.choice(letters + "23456789") for _ in range(4))
    )


def _flight(rng: random.Random) -> str:
    return f"{rng.choice(AIRLINES)}{rng.randint(100, 999)}"


def _percent(rng: random.Random) -> str:
    return f"{rng.randint(2, 60)}%"


def _time(rng: random.Random) -> str:
    return f"{rng.randint(6, 21):02d}:{rng.choice(('00', '15', '30', '45'))}"


# (fact kind or None, how to draw a value): see the module docstring for the fields.
Generator = tuple[str | None, Callable[[random.Random], str]]


@dataclass(frozen=True)
class Topic:
    """One subject of conversation: its words, fact generators, tools and phrasings."""

    name: str
    opener: str  # said with an explicit marker: "New topic: {opener}"
    words: dict[str, Sequence[str]]
    slots: dict[str, Generator]
    user: Sequence[str]
    assistant: Sequence[str]
    filler: Sequence[str]
    tools: Sequence[tuple[str, dict[str, str], str]]  # name, arguments (templates), result


TOPICS: tuple[Topic, ...] = (
    Topic(
        name="travel booking",
        opener="let's sort out the trip to {city}",
        words={
            "city": CITIES,
            "hotel": ("Hotel Aurora", "the Marina Suites", "Casa Verde", "the Grand Meridian"),
            "seat": ("aisle", "window", "exit row", "premium economy"),
            "bag": ("one checked bag", "carry-on only", "two checked bags"),
        },
        slots={
            "flight": ("flight", _flight),
            "ref": ("reference", _reference),
            "depart": ("date", _iso_date),
            "fare": ("amount", _small_amount),
            "traveller": ("name", _person),
            "time": (None, _time),
        },
        user=(
            "Can you find me a flight to {city} leaving on {depart!}? Seat preference: {seat}.",
            "Book {flight!} for {traveller!}, please, with {bag}.",
            "What does {hotel} in {city} cost per night around {depart}?",
            "The booking reference is {ref!}; can you check the seat on {flight}?",
            "Is there an earlier connection than {time} on {depart}?",
            "My budget for the flight is {fare!} at most.",
            "Please move the hotel check-in to the day after {depart}.",
        ),
        assistant=(
            "I found {flight!} to {city}, departing {depart} at {time}, for {fare!} including "
            "taxes.",
            "Booked: {flight} for {traveller}, booking reference {ref!}, {seat} seat.",
            "{hotel} has rooms from {fare} per night; breakfast is included and check-in "
            "starts at 15:00.",
            "The seat on {flight} is confirmed as {seat}; you can add {bag} online until 24 "
            "hours before departure.",
            "There is an earlier option at {time}, but it has a 55-minute layover, which is "
            "tight for a terminal change.",
        ),
        filler=(
            "Prices on this route usually rise in the last two weeks.",
            "The airline allows free changes up to 48 hours before departure.",
            "The airport train to the city centre takes about 30 minutes.",
            "Remember to check the passport validity rules for {city}.",
            "I can also set a price alert if you want to wait.",
        ),
        tools=(
            ("travel_search_flights", {"to": "{city}", "date": "{depart}"}, "3 results"),
            ("travel_get_booking", {"reference": "{ref}"}, "status: confirmed"),
        ),
    ),
    Topic(
        name="database migration",
        opener="the Postgres migration for the {service} service",
        words={
            "service": ("billing", "orders", "inventory", "auth", "search"),
            "table": ("invoices", "line_items", "customers", "sessions", "shipments"),
            "column": ("created_at", "tenant_id", "status", "amount_cents", "external_ref"),
            "version": ("14", "15", "16", "17"),
        },
        slots={
            "rows": ("count", lambda rng: f"{rng.randint(2, 480)} million rows"),
            "ticket": ("ticket", _ticket("DB")),
            "window": ("date", _iso_date),
            "owner": ("name", _person),
            "minutes": (None, lambda rng: f"{rng.randint(4, 90)} minutes"),
        },
        user=(
            "We need to move the {table} table of {service} to Postgres {version}; it holds "
            "{rows!}.",
            "How long would adding an index on {table}.{column} take without locking writes?",
            "The maintenance window is {window!}; {owner!} owns the rollback plan.",
            "Can we backfill {column} in batches so replication lag stays low?",
            "Track this under {ticket!}, please.",
            "What happens to foreign keys pointing at {table} during the cut-over?",
        ),
        assistant=(
            "Use CREATE INDEX CONCURRENTLY on {table}.{column}; for {rows} expect about "
            "{minutes} and no write locks.",
            "I would run the backfill in batches of 10,000 rows with a short sleep between "
            "them and watch replication lag.",
            "For the cut-over on {window}, switch writes with a feature flag, then drop the "
            "old trigger once {ticket!} is verified.",
            "Foreign keys to {table} should be created NOT VALID first and validated after the "
            "copy, so the validation does not block.",
            "pg_upgrade with --link keeps downtime to a few minutes for the {service} database.",
        ),
        filler=(
            "Logical replication lets you test the new cluster with production traffic first.",
            "Keep the old primary read-only for a day in case we need to roll back.",
            "Autovacuum settings may need tuning after the bulk load.",
            "I would also take a fresh base backup right before the window.",
        ),
        tools=(
            (
                "postgres_explain",
                {"query": "SELECT * FROM {table} WHERE {column} = $1"},
                "Index Scan using ix_{table}_{column}",
            ),
            ("postgres_table_size", {"table": "{table}"}, "{rows}, 182 GB"),
        ),
    ),
    Topic(
        name="birthday planning",
        opener="planning {friend}'s birthday party",
        words={
            "venue": ("the rooftop bar", "Luna Bistro", "the community hall", "our garden"),
            "cake": ("chocolate", "lemon drizzle", "carrot", "red velvet"),
            "theme": ("80s disco", "garden picnic", "murder mystery", "karaoke"),
        },
        slots={
            "friend": ("name", _person),
            "party": ("date", _spoken_date),
            "guests": ("count", lambda rng: f"{rng.randint(8, 60)} guests"),
            "deposit": ("amount", _small_amount),
            "time": (None, _time),
        },
        user=(
            "I want to throw a surprise party for {friend!} on {party!}.",
            "We expect around {guests!}; is {venue} big enough?",
            "What about a {theme} theme? {friend} loves that.",
            "The venue wants a deposit of {deposit!}. Is that normal?",
            "Can you draft the invitation text? Start at {time}.",
            "Should we order a {cake} cake or bake one?",
        ),
        assistant=(
            "For {guests}, {venue} works well; book it for {party} from {time} and ask about "
            "their decoration rules.",
            "A {theme} party fits: a playlist, a few props and a photo corner are enough.",
            "A deposit of {deposit} is common for private events; ask whether it is refundable.",
            "Invitation draft: You're invited to celebrate {friend} on {party} at {venue}, "
            "{time} sharp. Keep it a secret!",
            "A {cake} cake for {guests} needs two tiers; order it at least a week ahead.",
        ),
        filler=(
            "Ask one close friend to keep the guest of honour busy until everyone arrives.",
            "A shared shopping list avoids buying the same thing twice.",
            "Plan the speeches before the cake, while people are still around.",
        ),
        tools=(
            ("calendar_create_event", {"title": "Party for {friend}", "date": "{party}"}, "ok"),
        ),
    ),
    Topic(
        name="bug triage",
        opener="triaging the bugs from last night's release",
        words={
            "component": ("checkout", "invoice export", "login", "search", "notifications"),
            "symptom": ("a 500 error", "a timeout", "duplicate emails", "a blank page"),
            "severity": ("P1", "P2", "P3"),
            "browser": ("Safari 17", "Firefox", "Chrome on Android", "Edge"),
        },
        slots={
            "ticket": ("ticket", _ticket("INV")),
            "ticket2": ("ticket", _ticket("PAY")),
            "affected": ("count", lambda rng: f"{rng.randint(12, 4800)} users"),
            "assignee": ("name", _person),
            "build": ("reference", lambda rng: f"v2.{rng.randint(3, 19)}.{rng.randint(0, 9)}"),
            "rate": ("percent", _percent),
        },
        user=(
            "{ticket!} reports {symptom} in {component} since {build!}.",
            "How many users are affected by {ticket}? Support says {affected!}.",
            "Assign {ticket} to {assignee!}, severity {severity}.",
            "Is {ticket2!} a duplicate of {ticket}? Both mention {component}.",
            "The error rate on {component} went up to {rate!} after the deploy.",
            "Does it only happen on {browser}?",
        ),
        assistant=(
            "{ticket} looks like a regression from {build}: the {component} handler now "
            "times out when the cache is cold.",
            "I linked {ticket2} to {ticket!} as a duplicate; both stack traces end in the same "
            "serializer.",
            "Set {ticket} to {severity} and assigned it to {assignee}; {affected} are "
            "affected, mostly on {browser}.",
            "Rolling back {build} would bring the error rate from {rate} back under 1%.",
            "The fix needs a retry with backoff in {component} and a test for the cold-cache path.",
        ),
        filler=(
            "The logs show the first failure about five minutes after the deploy.",
            "We should add an alert on this error rate so we hear about it before support.",
            "A feature flag would let us disable the new code path without a rollback.",
        ),
        tools=(
            ("jira_get_issue", {"key": "{ticket}"}, "{ticket}: {symptom} in {component}, open"),
            ("jira_update_issue", {"key": "{ticket}", "assignee": "{assignee}"}, "updated"),
        ),
    ),
    Topic(
        name="budget planning",
        opener="the {quarter} budget for the {team} team",
        words={
            "team": ("platform", "marketing", "design", "data", "support"),
            "quarter": ("Q1", "Q2", "Q3", "Q4"),
            "line": ("cloud hosting", "contractors", "conference travel", "software licences"),
        },
        slots={
            "total": ("amount", _amount),
            "line_amount": ("amount", _amount),
            "cut": ("percent", _percent),
            "approver": ("name", _person),
            "due": ("date", _iso_date),
            "po": ("ticket", _ticket("PO")),
        },
        user=(
            "The {team} budget for {quarter} is {total!} in total.",
            "We spent {line_amount!} on {line} last quarter; can we cut that by {cut!}?",
            "{approver!} has to sign off before {due!}.",
            "Raise a purchase order for {line}: {po!}.",
            "What share of the budget goes to {line}?",
        ),
        assistant=(
            "Out of {total}, {line} takes {line_amount}, so a {cut} cut frees up a useful "
            "amount for hiring.",
            "I drafted the {quarter} plan: {line} at {line_amount!}, the rest split between "
            "salaries and tooling, total {total!}.",
            "{po} is raised for {line} and waiting for {approver}'s approval, due {due}.",
            "Committed spend is about two thirds of {total}; the remainder is discretionary.",
        ),
        filler=(
            "Annual contracts are usually 15% cheaper than monthly ones.",
            "Keep a reserve for unplanned incidents; last year it was needed twice.",
            "Finance wants the numbers in the shared sheet, not in slides.",
        ),
        tools=(
            ("sheets_read_range", {"range": "{quarter}!A1:F40"}, "42 rows"),
            ("sheets_write_range", {"range": "{quarter}!B7", "value": "{line_amount}"}, "ok"),
        ),
    ),
    Topic(
        name="hiring",
        opener="hiring for the {role} opening",
        words={
            "role": ("senior backend engineer", "data analyst", "product designer", "SRE"),
            "stage": ("phone screen", "take-home task", "system design interview", "final"),
        },
        slots={
            "candidate": ("name", _person),
            "salary": ("amount", _amount),
            "interview": ("date", _iso_date),
            "req": ("ticket", _ticket("REQ")),
            "time": (None, _time),
        },
        user=(
            "Schedule the {stage} with {candidate!} on {interview!} at {time}.",
            "The salary band for the {role} is up to {salary!}.",
            "Which questions should we ask in the {stage}?",
            "Open a requisition for the {role}: {req!}.",
        ),
        assistant=(
            "Scheduled: {stage} with {candidate} on {interview} at {time}; the invite went out.",
            "For the {stage}, ask about a system they built, what broke, and what they would "
            "change.",
            "{req!} is open for the {role} with a band up to {salary}.",
            "{candidate} did well in the {stage}; I would move them to the next round.",
        ),
        filler=(
            "Structured scorecards make the debrief much faster.",
            "Reply to every candidate within a week, even with a no.",
        ),
        tools=(("calendar_find_slot", {"attendee": "{candidate}", "date": "{interview}"}, "ok"),),
    ),
    Topic(
        name="home renovation",
        opener="the kitchen renovation",
        words={
            "room": ("kitchen", "bathroom", "attic"),
            "material": ("oak flooring", "quartz worktops", "subway tiles", "cork panels"),
            "trade": ("electrician", "plumber", "tiler", "carpenter"),
        },
        slots={
            "quote": ("amount", _amount),
            "start": ("date", _spoken_date),
            "contractor": ("name", _person),
            "area": ("count", lambda rng: f"{rng.randint(8, 60)} square metres"),
        },
        user=(
            "{contractor!} quoted {quote!} for the {room}. Is that reasonable?",
            "The {room} is about {area!}; how much {material} do we need?",
            "Work starts on {start!}; when should the {trade} come?",
            "Can we keep the old cabinets to save money?",
        ),
        assistant=(
            "For {area}, {quote} is within the usual range if it includes the {trade} and "
            "disposal.",
            "Order {material} for {area} plus 10% for cuts and waste.",
            "Book the {trade} for the first week after {start}, before the walls are closed.",
            "Keeping the cabinets and changing only the doors saves a lot; check the hinges.",
        ),
        filler=(
            "Get at least three quotes, itemised, so they are comparable.",
            "Ask whether the quote includes the permit fees.",
        ),
        tools=(),
    ),
)
