"""A small extractive-QA set in SQuAD v1.1 JSON, generated from invented facts.

    python -m tempo.bert.data.qa_generator --out_dir data/qa --num_train 2000 --num_dev 300 --seed 1

Each paragraph tells a few facts about two invented people (birthplace, birth year, and for one
of them an invention or a company founded) and a city or river involved, so every question has
same-type distractors in its context ("Where was X born?" next to "Y was born in Z"). Names are
built from syllables; each name belongs to the train or the dev split by a hash of its spelling,
independent of the seed, so dev entities never occur in any train set: a model can only answer
dev questions by reading the context. Years and numbers are shared (they carry no identity).

Writes ``train-v1.1.json`` and ``dev-v1.1.json`` to ``--out_dir``; answer_start is recorded
while the paragraph is assembled, never searched for.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
from pathlib import Path
from typing import Callable

from tempo.utils import atomic_write

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s", "sh",
           "t", "th", "tr", "v", "w", "z", "st", "qu"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "m", "nd", "rk", "x"]
_CITY_ENDINGS = ["ford", "heim", "port", "ville", "stad", "burg", "mouth", "wick", "dale", "grad"]
_COMPANY_KINDS = ["Works", "Industries", "Instruments", "Foundry", "Laboratories", "Company"]
_INVENTION_KINDS = ["engine", "lamp", "loom", "compass", "telescope", "pump", "press", "clock",
                    "valve", "kiln"]
_PRODUCTS = ["bicycles", "glassware", "radios", "pianos", "ropes", "typewriters", "lenses", "boats"]
_PROFESSIONS = ["engineer", "chemist", "architect", "painter", "merchant", "physician", "sailor"]

SPLITS = ("train", "dev")


def _split_of(name: str) -> str:
    # One fifth of all spellings are reserved for dev, whatever the seed.
    return "dev" if hashlib.sha256(name.encode()).digest()[0] % 5 == 0 else "train"


def _syllable(rng: random.Random) -> str:
    return rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(_syllable(rng) for _ in range(syllables)).capitalize()


class _Names:
    """Fresh invented names of the requested split, never repeated within one generated set."""

    def __init__(self, rng: random.Random, split: str):
        self.rng, self.split, self.used = rng, split, set()

    def _draw(self, make: Callable[[], str]) -> str:
        while True:
            name = make()
            if name not in self.used and _split_of(name) == self.split:
                self.used.add(name)
                return name

    # Short names (one or two syllables a word) keep paragraphs near 60 WordPiece tokens (~70 with longer names): invented
    # spellings split into several pieces each, and sequence length is what CPU fine-tuning pays for.
    def person(self) -> str:
        return self._draw(lambda: f"{_word(self.rng, 1)} {_word(self.rng, self.rng.choice((1, 2)))}")

    def city(self) -> str:
        return self._draw(lambda: _word(self.rng, 1) + self.rng.choice(_CITY_ENDINGS))

    def river(self) -> str:
        return self._draw(lambda: _word(self.rng, self.rng.choice((1, 2))))

    def company(self) -> str:
        return self._draw(lambda: f"{_word(self.rng, self.rng.choice((1, 2)))} {self.rng.choice(_COMPANY_KINDS)}")

    def invention(self) -> str:
        return self._draw(lambda: f"{_word(self.rng, 1).lower()} {self.rng.choice(_INVENTION_KINDS)}")


class _Paragraph:
    """Sentences appended one by one; answers are recorded with their character offsets."""

    def __init__(self) -> None:
        self.text = ""
        self.facts: list[tuple[str, str, int]] = []  # (question, answer, answer_start)

    def add(self, template: str, values: dict[str, str], questions: dict[str, list[str]]) -> None:
        """``template`` uses {key} slots; ``questions`` maps a slot to question phrasings whose
        answer is that slot's value."""
        start = len(self.text) + (1 if self.text else 0)
        sentence = template.format(**values)
        self.text += (" " if self.text else "") + sentence
        for key, phrasings in questions.items():
            # Position of the slot inside the sentence: format the text before it.
            before = template[:template.index("{" + key + "}")].format(**values)
            for question in phrasings:
                self.facts.append((question, values[key], start + len(before)))


def _person_facts(par: _Paragraph, names: _Names, rng: random.Random, person: str, with_work: bool) -> str:
    city, year = names.city(), str(rng.randint(1700, 1990))
    profession = rng.choice(_PROFESSIONS)
    v = {"p": person, "c": city, "y": year, "job": profession,
         "a": "an" if profession[0] in "aeiou" else "a"}
    template = rng.choice(["{p} was born in {c} in {y}.", "{p}, {a} {job}, was born in {c} in {y}.",
                           "In {y}, the {job} {p} was born in {c}."])
    par.add(template, v, {"c": [f"Where was {person} born?", f"In which city was {person} born?"],
                          "y": [f"In what year was {person} born?", f"When was {person} born?"]})
    if not with_work:
        return city
    if rng.random() < 0.5:
        v = {"p": person, "i": names.invention(), "y": str(int(year) + rng.randint(20, 50))}
        par.add(rng.choice(["{p} invented the {i} in {y}.", "In {y}, {p} invented the {i}."]), v,
                {"i": [f"What did {person} invent?"], "p": [f"Who invented the {v['i']}?"],
                 "y": [f"When was the {v['i']} invented?"]})
    else:
        v = {"p": person, "co": names.company(), "y": str(int(year) + rng.randint(20, 50)),
             "goods": rng.choice(_PRODUCTS)}
        par.add(rng.choice(["In {y}, {p} founded {co}, a maker of {goods}.",
                            "{p} founded {co} in {y}; it made {goods}."]), v,
                {"co": [f"Which company did {person} found?"], "p": [f"Who founded {v['co']}?"],
                 "y": [f"When was {v['co']} founded?"], "goods": [f"What did {v['co']} make?"]})
    return city


def _city_facts(par: _Paragraph, names: _Names, rng: random.Random, city: str) -> None:
    v = {"c": city, "r": names.river() + " River", "km": f"{rng.randint(40, 2900)} kilometres",
         "pop": f"{rng.randint(2, 900)},{rng.randint(0, 999):03d}"}
    kind = rng.random()
    if kind < 0.4:
        par.add("{c} lies on the {r}, which is {km} long.", v,
                {"r": [f"Which river flows through {city}?", f"On which river does {city} lie?"],
                 "km": [f"How long is the {v['r']}?"]})
    elif kind < 0.7:
        par.add("{c} has a population of {pop}.", v, {"pop": [f"What is the population of {city}?",
                                                               f"How many people live in {city}?"]})
    else:
        par.add("The {r} runs past {c} and is {km} long.", v,
                {"r": [f"Which river runs past {city}?"], "km": [f"What is the length of the {v['r']}?"]})


def generate_split(split: str, num_questions: int, seed: int, questions_per_paragraph: int = 3) -> dict:
    """One split as a SQuAD v1.1 dict with ``num_questions`` questions."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}")
    rng = random.Random(f"{seed}-{split}")
    names = _Names(rng, split)
    paragraphs = []
    count = 0
    while count < num_questions:
        par = _Paragraph()
        people = [names.person(), names.person()]  # two of each kind: every answer has a distractor
        worker = rng.randrange(2)  # one invention or company per paragraph keeps it short
        cities = [_person_facts(par, names, rng, person, i == worker) for i, person in enumerate(people)]
        _city_facts(par, names, rng, rng.choice(cities))
        take = min(questions_per_paragraph, num_questions - count, len(par.facts))
        qas = []
        for q, (question, answer, start) in enumerate(rng.sample(par.facts, k=take)):
            assert par.text[start:start + len(answer)] == answer  # offsets are recorded, not searched
            qas.append({"id": f"{split}-{len(paragraphs):05d}-{q}", "question": question,
                        "answers": [{"text": answer, "answer_start": start}]})
        count += len(qas)
        paragraphs.append({"context": par.text, "qas": qas})
    # Ten paragraphs per "article", like SQuAD's titles-with-many-paragraphs layout.
    data = [{"title": f"{split}_{i // 10:04d}", "paragraphs": paragraphs[i:i + 10]}
            for i in range(0, len(paragraphs), 10)]
    return {"version": "1.1", "data": data}


def _write_json(obj: dict, path: Path) -> None:
    with atomic_write(path) as fh:
        json.dump(obj, fh, ensure_ascii=False)


def write_qa_set(out_dir: str | os.PathLike, num_train: int, num_dev: int, seed: int = 0) -> tuple[Path, Path]:
    """Write train-v1.1.json and dev-v1.1.json; returns their paths."""
    out = Path(out_dir)
    train, dev = out / "train-v1.1.json", out / "dev-v1.1.json"
    _write_json(generate_split("train", num_train, seed), train)
    _write_json(generate_split("dev", num_dev, seed), dev)
    return train, dev


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tempo.bert.data.qa_generator", description=__doc__.split("\n\n")[0])
    p.add_argument("--out_dir", required=True)
    p.add_argument("--num_train", type=int, default=2000, help="training questions")
    p.add_argument("--num_dev", type=int, default=300, help="held-out questions (unseen entity names)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.num_train < 1 or args.num_dev < 1:
        p.error("--num_train and --num_dev must be positive")
    train, dev = write_qa_set(args.out_dir, args.num_train, args.num_dev, args.seed)
    print(f"wrote {train} ({args.num_train} questions) and {dev} ({args.num_dev} questions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
