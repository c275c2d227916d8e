"""Writes the local data of the two lm-eval tasks beside this file (run once; the files are
committed, so the tasks never need the hub): capitals.jsonl, 40 four-way questions (the three
wrong choices other countries' capitals, picked by fixed offsets), and pydoc.jsonl, eight
passages of Python's own `pydoc_data.topics` for a rolling-loglikelihood (perplexity) task.
Usage: python docs/benchmarks/lm_eval/make_data.py
"""

import json
from pathlib import Path
from pydoc_data.topics import topics

CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Portugal", "Lisbon"),
    ("Japan", "Tokyo"),
    ("China", "Beijing"),
    ("India", "New Delhi"),
    ("Russia", "Moscow"),
    ("Canada", "Ottawa"),
    ("Australia", "Canberra"),
    ("Brazil", "Brasilia"),
    ("Argentina", "Buenos Aires"),
    ("Mexico", "Mexico City"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Greece", "Athens"),
    ("Turkey", "Ankara"),
    ("Poland", "Warsaw"),
    ("Austria", "Vienna"),
    ("Sweden", "Stockholm"),
    ("Norway", "Oslo"),
    ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"),
    ("Ireland", "Dublin"),
    ("Netherlands", "Amsterdam"),
    ("Belgium", "Brussels"),
    ("Switzerland", "Bern"),
    ("Hungary", "Budapest"),
    ("Czechia", "Prague"),
    ("Peru", "Lima"),
    ("Chile", "Santiago"),
    ("Colombia", "Bogota"),
    ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"),
    ("Indonesia", "Jakarta"),
    ("South Korea", "Seoul"),
    ("Iran", "Tehran"),
    ("Nigeria", "Abuja"),
    ("Morocco", "Rabat"),
]
TOPICS = ["assert", "break", "continue", "del", "global", "pass", "return", "while"]

here = Path(__file__).parent
with open(here / "capitals.jsonl", "w") as f:
    for i, (country, capital) in enumerate(CAPITALS):
        wrong = [CAPITALS[(i + o) % len(CAPITALS)][1] for o in (7, 15, 26)]
        choices = wrong[: i % 4] + [capital] + wrong[i % 4 :]
        f.write(json.dumps({"country": country, "choices": choices, "answer": i % 4}) + "\n")
with open(here / "pydoc.jsonl", "w") as f:
    for name in TOPICS:
        f.write(json.dumps({"topic": name, "text": topics[name].strip()}) + "\n")
