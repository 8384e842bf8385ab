"""Build JSON-schema prompts for a target's lookup corpus (issue 31; docs/lookup.md).

    .venv/bin/python training/structured_prompts.py --out training/data/coder05/structured_prompts.jsonl

Each line is `{"id", "kind", "prompt", "schema"}`, the packaged `structured` bench set's form, so
`training/answer_structured.py` answers them under their grammars. The kinds are the bench
set's (extraction into a schema, function arguments, nested objects, a reasoning answer), and
the texts are not: every prompt is built from the templates and name lists below (seeded), with
schemas of their own; none shares a schema or a sentence with the bench set, which the script
checks. What the target writes for them is what an agent's earlier calls look like: the
formatting habits and value shapes its next JSON answers repeat.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from mlx_dflash.benchmark.datasets import PACKAGED
from mlx_dflash.prompt_files import read_records

FIRST = ["Ana", "Kofi", "Mei", "Lars", "Fatima", "Diego", "Yuki", "Olga", "Ravi", "Chloe",
         "Tomasz", "Amara", "Hugo", "Ingrid", "Sami", "Lucia"]  # fmt: skip
LAST = ["Silva", "Mensah", "Chen", "Eriksson", "Haddad", "Ortega", "Tanaka", "Petrova",
        "Iyer", "Dubois", "Nowak", "Obi", "Laurent", "Berg", "Karimi", "Rossi"]  # fmt: skip
COMPANIES = ["Bluepeak Systems", "Harbor & Finch", "Quanta Foods", "Verdant Energy",
             "Kite Logistics", "Orchid Health", "Ironbark Labs", "Saffron Media"]  # fmt: skip
CITIES = ["Oslo", "Nairobi", "Lima", "Osaka", "Porto", "Denver", "Krakow", "Hanoi",
          "Dublin", "Cape Town", "Montreal", "Seville"]  # fmt: skip
ROLES = ["Product Manager", "Backend Developer", "Head of Sales", "QA Lead",
         "Data Scientist", "Office Manager", "Security Engineer", "UX Researcher"]  # fmt: skip
PRODUCTS = [("wireless mouse", 24.99), ("USB-C hub", 39.5), ("desk lamp", 18.0),
            ("notebook", 3.25), ("water bottle", 12.75), ("keyboard", 59.0),
            ("phone case", 15.4), ("monitor stand", 44.9)]  # fmt: skip
MONTHS = ["January", "February", "April", "June", "July", "September", "October", "November"]


def s(n: int) -> dict:
    return {"type": "string", "maxLength": n}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}  # fmt: skip


def person(r: random.Random) -> str:
    return f"{r.choice(FIRST)} {r.choice(LAST)}"


def contact(r):
    name, company, city = person(r), r.choice(COMPANIES), r.choice(CITIES)
    user = name.lower().replace(" ", ".")
    domain = company.split()[0].lower().strip("&") + ".com"
    text = (f"Extract the person from this business card as JSON.\n\n{name}\n{r.choice(ROLES)}\n"
            f"{company}, {city}\nMobile {r.randint(200, 999)} {r.randint(100, 999)} "
            f"{r.randint(1000, 9999)}\n{user}@{domain}")  # fmt: skip
    schema = obj({"full_name": s(60), "role": s(60), "organization": s(60), "city": s(40),
                  "mobile": s(30), "email": s(60)})  # fmt: skip
    return text, schema


def meeting(r):
    who, city = person(r), r.choice(CITIES)
    day, month = r.randint(1, 28), r.choice(MONTHS)
    hour = r.choice(["8:00", "10:15", "13:30", "16:45"])
    text = (f'Extract the appointment from this note as JSON: "{who} meets the {city} '
            f'suppliers on {month} {day} at {hour}, room {r.randint(1, 40)}, about the '
            f'{r.choice(["budget", "contract", "roadmap", "hiring plan"])}."')  # fmt: skip
    schema = obj({"attendee": s(40), "date": s(30), "time": s(10), "room": s(20),
                  "topic": s(60)})  # fmt: skip
    return text, schema


def film(r):
    films = [("Spirited Away", "Hayao Miyazaki", 2001, "animation", 125),
             ("Alien", "Ridley Scott", 1979, "science fiction", 117),
             ("Amelie", "Jean-Pierre Jeunet", 2001, "comedy", 122),
             ("Heat", "Michael Mann", 1995, "crime", 170),
             ("Parasite", "Bong Joon-ho", 2019, "thriller", 132),
             ("Casablanca", "Michael Curtiz", 1942, "drama", 102)]  # fmt: skip
    t, d, y, g, m = r.choice(films)
    seen = r.choice(["last week", "at a festival", "twice", "on a plane"])
    text = (f"Return this film as JSON: {t}, directed by {d} ({y}), a {g} of {m} minutes "
            f"that I watched {seen}.")  # fmt: skip
    schema = obj({"title": s(60), "director": s(60), "year": {"type": "integer", "minimum": 1880,
                  "maximum": 2100}, "genre": s(30), "runtime_minutes": {"type": "integer",
                  "minimum": 1, "maximum": 600}})  # fmt: skip
    return text, schema


def tool_call(r):
    calls = [
        ("get_stock_price(symbol, currency)", f"what is {r.choice(['Apple', 'Tesla', 'Nvidia'])} "
         f"trading at, in {r.choice(['dollars', 'euros'])}?",
         obj({"symbol": s(10), "currency": {"enum": ["USD", "EUR", "GBP"]}})),
        ("translate_text(text, source_language, target_language)",
         f"translate 'where is the {r.choice(['station', 'museum', 'pharmacy'])}' from English "
         f"to {r.choice(['Spanish', 'German', 'Japanese'])}",
         obj({"text": s(100), "source_language": s(20), "target_language": s(20)})),
        ("book_flight(origin, destination, date, passengers)",
         f"book {r.randint(1, 4)} seats from {r.choice(CITIES)} to {r.choice(CITIES)} on "
         f"{r.choice(MONTHS)} {r.randint(1, 28)}",
         obj({"origin": s(40), "destination": s(40), "date": s(30),
              "passengers": {"type": "integer", "minimum": 1, "maximum": 9}})),
        ("git_commit(message, files, amend)",
         f"commit the changes to {r.choice(['main.py', 'setup.cfg', 'README.md'])} and "
         f"{r.choice(['utils.py', 'tests/test_io.py', 'Makefile'])} with a message about "
         f"{r.choice(['fixing the parser', 'bumping the version', 'adding logging'])}",
         obj({"message": s(80), "files": {"type": "array", "items": s(60), "minItems": 1,
              "maxItems": 5}, "amend": {"type": "boolean"}})),
        ("set_timer(label, minutes, repeat)",
         f"remind me to {r.choice(['stretch', 'check the oven', 'call mum'])} in "
         f"{r.choice([5, 15, 25, 45])} minutes",
         obj({"label": s(40), "minutes": {"type": "integer", "minimum": 1, "maximum": 1440},
              "repeat": {"type": "boolean"}})),
        ("query_database(table, filters, limit)",
         f"show the last {r.choice([10, 50, 100])} orders from {r.choice(CITIES)} over "
         f"{r.choice([20, 100, 500])} dollars",
         obj({"table": s(30), "filters": {"type": "array", "items": s(60), "maxItems": 4},
              "limit": {"type": "integer", "minimum": 1, "maximum": 1000}})),
    ]  # fmt: skip
    sig, ask, schema = r.choice(calls)
    name = sig.split("(")[0]
    text = (f"You can call {sig}. The user says: {ask}. Reply with the arguments of the "
            f"{name} call as JSON.")  # fmt: skip
    return text, schema


def invoice(r):
    items = r.sample(PRODUCTS, r.randint(1, 3))
    parts = [f"{r.randint(1, 5)} x {n} at {p:.2f}" for n, p in items]
    text = (f"Turn this purchase into JSON: {', '.join(parts)}, shipped to "
            f"{r.randint(1, 200)} {r.choice(['High Street', 'Elm Road', 'Rua Nova'])}, "
            f"{r.choice(CITIES)}, {r.choice(['express', 'standard'])} delivery.")  # fmt: skip
    line = obj({"product": s(40), "count": {"type": "integer", "minimum": 1, "maximum": 100},
                "price": {"type": "number", "minimum": 0, "maximum": 10000}})  # fmt: skip
    schema = obj({"lines": {"type": "array", "items": line, "minItems": 1, "maxItems": 6},
                  "address": s(80), "shipping": {"enum": ["express", "standard"]}})  # fmt: skip
    return text, schema


def review(r):
    good = r.sample(["fast delivery", "great sound", "long battery", "sturdy build",
                     "friendly support", "easy setup"], 2)  # fmt: skip
    bad = r.sample(["loud fan", "short cable", "weak wifi", "confusing app", "high price"], 1)
    text = (
        f"Rate this customer comment and list what it praises and criticises as JSON: "
        f'"{good[0].capitalize()} and {good[1]}, though the {bad[0]} annoys me."'
    )
    schema = obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5},
                  "tone": {"enum": ["positive", "negative", "mixed"]},
                  "praise": {"type": "array", "items": s(50), "maxItems": 4},
                  "criticism": {"type": "array", "items": s(50), "maxItems": 4}})  # fmt: skip
    return text, schema


def team(r):
    names = [person(r) for _ in range(r.randint(2, 4))]
    roles = r.sample(ROLES, len(names))
    said = ", ".join(f"{n} ({ro})" for n, ro in zip(names, roles, strict=True))
    text = f'List the team members and their jobs in this update as JSON: "This sprint: {said}."'
    member = obj({"name": s(40), "job": s(40)})
    schema = obj({"members": {"type": "array", "items": member, "minItems": 1, "maxItems": 6}})
    return text, schema


def settings(r):
    what = r.choice([
        ("a database connection: driver, host, port, database name, and a pool with min and "
         "max sizes", obj({"driver": s(20), "host": s(40), "port": {"type": "integer",
          "minimum": 1, "maximum": 65535}, "database": s(40), "pool": obj({"min_size":
          {"type": "integer", "minimum": 0, "maximum": 100}, "max_size": {"type": "integer",
          "minimum": 1, "maximum": 1000}})})),
        ("a logging setup: level, format string, and up to three handlers with a type and a "
         "target", obj({"level": {"enum": ["DEBUG", "INFO", "WARNING", "ERROR"]}, "format":
          s(80), "handlers": {"type": "array", "items": obj({"type": s(20), "target": s(60)}),
          "maxItems": 3}})),
        ("a CI job: name, image, the commands to run, and whether it caches dependencies",
         obj({"name": s(40), "image": s(60), "commands": {"type": "array", "items": s(80),
              "minItems": 1, "maxItems": 5}, "cache": {"type": "boolean"}})),
    ])  # fmt: skip
    service = r.choice(["billing", "search", "auth", "reports", "inventory", "chat"])
    return f"Return a JSON configuration for {what[0]}, for the {service} service.", what[1]


def incident(r):
    app = r.choice(["the checkout page", "the mobile app", "the export button", "login"])
    what = r.choice(["times out", "shows a blank screen", "logs me out", "freezes"])
    when = r.choice(["after the update", "on Safari", "with two tabs open", "every morning"])
    text = (
        f'A customer writes: "{app.capitalize()} {what} {when}." Log it as a support case in JSON.'
    )
    schema = obj({"summary": s(80), "priority": {"enum": ["P1", "P2", "P3", "P4"]},
                  "component": s(40), "environment": s(60),
                  "next_steps": {"type": "array", "items": s(100), "minItems": 1,
                                 "maxItems": 3}})  # fmt: skip
    return text, schema


def word_problem(r):
    a, b, c = r.randint(3, 40), r.randint(2, 12), r.randint(1, 30)
    thing = r.choice(["boxes of apples", "crates of books", "bags of rice"])
    text = (f"Answer as JSON with your working and the final number: a shop gets {a} {thing} "
            f"with {b} in each, sells {c} of the items, and how many are left?")  # fmt: skip
    schema = obj({"working": {"type": "array", "items": s(120), "minItems": 1, "maxItems": 4},
                  "result": {"type": "number"}})  # fmt: skip
    return text, schema


KINDS = [contact, meeting, film, tool_call, invoice, review, team, settings, incident,
         word_problem]  # fmt: skip


def build(count: int, seed: int) -> list[dict]:
    r = random.Random(seed)
    bench = list(read_records(PACKAGED["structured"]))
    seen, out = set(), []
    for attempt in range(100 * count):  # a kind whose texts run out gives way to the others
        if len(out) == count:
            break
        kind = KINDS[attempt % len(KINDS)]
        text, schema = kind(r)
        if text in seen:
            continue
        assert all(text != b["prompt"] and schema != b["schema"] for b in bench), text
        seen.add(text)
        out.append({"id": f"json_{len(out):03d}", "kind": kind.__name__, "prompt": text,
                    "schema": schema})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    with open(a.out, "w", encoding="utf-8") as f:
        for rec in build(a.count, a.seed):
            f.write(json.dumps(rec) + "\n")
    print(f"{a.count} prompts -> {a.out}")


if __name__ == "__main__":
    main()
