"""A built-in synthetic corpus so the pretraining demo needs no download.

``write_sample_corpus(out_dir, num_documents=2000, seed=0)`` invents a small
world from the seed (countries, cities, rivers, people, companies, animals with
made-up names and fixed facts) and writes encyclopedia-style documents about
its entities in DLE's layout: one sentence per line, a blank line between
documents. Facts are consistent inside a document and across documents, and
sentences within a document follow a fixed topic order, so both masked-LM and
next-sentence prediction have something real to learn. All words except the
invented names are plain English, so an uncased BERT vocab covers them; the
names become several word pieces.

The text is generated from the grammar below (written for this project); the
output depends only on ``seed`` and ``num_documents``.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from tempo.utils import atomic_write_text

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "tr",
           "v", "w", "z", "x", "sh", "th"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ei", "ae"]
_CODAS = ["", "", "n", "r", "l", "s", "k", "m", "th", "nd", "rk", "st", "v"]
_GIVEN_FEMALE = ["anna", "lena", "ida", "nora", "clara", "ruth", "elena", "mira", "sara", "alma", "greta", "olga"]
_GIVEN_MALE = ["marek", "tomas", "oskar", "felix", "jonas", "pavel", "victor", "hugo", "leon", "emil", "david", "simon"]

_PROFESSIONS = {
    "painter": ("paintings", "painted", "landscapes of"),
    "engineer": ("bridges", "designed", "a railway bridge near"),
    "botanist": ("studies of plants", "described", "the wild flowers of"),
    "composer": ("songs", "wrote", "a long symphony about"),
    "architect": ("buildings", "built", "the central library of"),
    "physician": ("hospitals", "founded", "a small hospital in"),
    "writer": ("novels", "wrote", "a famous novel set in"),
    "astronomer": ("maps of the sky", "observed", "a bright comet from"),
}
_INDUSTRIES = ["fishing", "farming", "mining", "shipbuilding", "textiles", "trade", "tourism", "printing",
               "brewing", "timber", "glass making", "furniture"]
_LANDMARKS = ["old stone bridge", "red castle", "white tower", "market square", "harbor", "cathedral",
              "botanical garden", "city hall", "clock tower", "public library", "music hall", "old mill"]
_CLIMATES = [("cold and snowy", "short and mild"), ("mild and wet", "warm and dry"), ("cool and windy", "pleasant"),
             ("dark and long", "bright and cool"), ("short and rainy", "long and hot")]
_PRODUCTS = ["bicycles", "paper", "steel tools", "radios", "boats", "shoes", "tea", "glass bottles", "clocks",
             "medicine", "toys", "maps", "pianos", "bread"]
_ANIMAL_KINDS = {
    "bird": ("sings", "seeds and insects", "nests in tall trees"),
    "fox": ("hunts at night", "mice and berries", "lives in dens under the roots of trees"),
    "fish": ("swims in cold water", "small insects", "lays its eggs among stones"),
    "frog": ("calls loudly after rain", "flies and worms", "spends the winter in the mud"),
    "deer": ("moves in small groups", "grass and leaves", "rests in quiet valleys"),
    "owl": ("hunts in the evening", "mice and beetles", "nests in old buildings"),
}
_COLORS = ["brown", "grey", "red", "black", "white", "green", "yellow", "blue"]
_HABITATS = ["forests", "mountains", "wetlands", "grasslands", "rivers", "coastal cliffs", "lakes"]
_SEAS = ["northern sea", "eastern sea", "southern sea", "western ocean", "great lake"]
_DIRECTIONS = ["north", "south", "east", "west", "center"]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _capitalize(s: str) -> str:
    return s[:1].upper() + s[1:]


@dataclass
class _World:
    rng: random.Random
    used_names: set = field(default_factory=set)

    def name(self, syllables: tuple[int, int] = (2, 3)) -> str:
        while True:
            n = self.rng.randint(*syllables)
            word = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                           for _ in range(n))
            if 4 <= len(word) <= 10 and word not in self.used_names:
                self.used_names.add(word)
                return _capitalize(word)


def _build_world(rng: random.Random) -> dict:
    w = _World(rng)
    countries = [{"name": w.name(), "climate": rng.choice(_CLIMATES), "mountains": w.name() + " Mountains"}
                 for _ in range(10)]
    rivers = [{"name": w.name(), "country": rng.choice(countries), "sea": rng.choice(_SEAS),
               "length": rng.randrange(80, 2400, 10), "cities": []} for _ in range(30)]
    cities = []
    for _ in range(100):
        river = rng.choice(rivers)
        city = {"name": w.name(), "country": river["country"], "river": river,
                "founded": rng.randint(900, 1850), "population": rng.randrange(2_000, 900_000, 500),
                "industry": rng.choice(_INDUSTRIES), "landmark": rng.choice(_LANDMARKS),
                "direction": rng.choice(_DIRECTIONS), "festival": w.name() + " " + rng.choice(["spring", "harvest", "lantern", "river", "winter"])}
        river["cities"].append(city)
        cities.append(city)
    for country in countries:
        own = [c for c in cities if c["country"] is country]
        country["capital"] = max(own, key=lambda c: c["population"]) if own else rng.choice(cities)
    people = []
    for _ in range(120):
        prof = rng.choice(sorted(_PROFESSIONS))
        born = rng.randint(1700, 1960)
        she = rng.random() < 0.5
        given = rng.choice(_GIVEN_FEMALE if she else _GIVEN_MALE)
        people.append({"name": f"{_capitalize(given)} {w.name()}", "profession": prof,
                       "born": born, "died": born + rng.randint(35, 95), "city": rng.choice(cities),
                       "work_city": rng.choice(cities), "she": she})
    for city in cities:
        city["natives"] = [p for p in people if p["city"] is city]
    companies = [{"name": w.name() + rng.choice([" Works", " and Sons", " Company", " Brothers"]),
                  "product": rng.choice(_PRODUCTS), "founded": rng.randint(1780, 1990),
                  "city": rng.choice(cities), "founder": rng.choice(people),
                  "workers": rng.randrange(20, 20_000, 10)} for _ in range(50)]
    animals = [{"name": w.name(), "kind": rng.choice(sorted(_ANIMAL_KINDS)), "color": rng.choice(_COLORS),
                "habitat": rng.choice(_HABITATS), "country": rng.choice(countries),
                "size": rng.randint(5, 180)} for _ in range(40)]
    return {"countries": countries, "rivers": rivers, "cities": cities, "people": people,
            "companies": companies, "animals": animals}


def _pick(rng: random.Random, *options: str) -> str:
    return rng.choice(options)


def _city_doc(c: dict, rng: random.Random) -> list[str]:
    n, country, river = c["name"], c["country"], c["river"]
    winter, summer = country["climate"]
    s = [
        _pick(rng, f"{n} is a city in the {c['direction']} of {country['name']}.",
              f"{n} is a town in {country['name']}, in the {c['direction']} of the country."),
        f"It lies on the river {river['name']}, which flows into the {river['sea']}.",
        _pick(rng, f"The city was founded in {c['founded']}.", f"{n} was first mentioned in records from {c['founded']}."),
        _pick(rng, f"About {c['population']:,} people live in {n}.", f"The population of {n} is about {c['population']:,}."),
    ]
    if country["capital"] is c:
        s.append(f"{n} is the capital and the largest city of {country['name']}.")
    s += [
        _pick(rng, f"The main industry of {n} is {c['industry']}.", f"For a long time, {c['industry']} was the most important work in the city."),
        f"The {c['landmark']} is the best known building in {n}.",
        f"In winter the weather is {winter}, and the summers are {summer}.",
        f"Every year many visitors come to {n} for the {c['festival']} festival.",
    ]
    neighbors = [o for o in river["cities"] if o is not c]
    if neighbors:
        o = rng.choice(neighbors)
        s.append(f"A road along the {river['name']} connects {n} with {o['name']}.")
    for p in c["natives"][:2]:
        s.append(f"The {p['profession']} {p['name']} was born in {n} in {p['born']}.")
    return _drop_some(s, rng, keep_first=2)


def _river_doc(r: dict, rng: random.Random) -> list[str]:
    n = r["name"]
    s = [
        f"The {n} is a river in {r['country']['name']}.",
        f"It rises in the {r['country']['mountains']} and flows into the {r['sea']}.",
        _pick(rng, f"The river is about {r['length']} kilometers long.", f"Its total length is {r['length']} kilometers."),
    ]
    for c in r["cities"][:4]:
        s.append(_pick(rng, f"The city of {c['name']} lies on its banks.", f"The {n} passes through {c['name']}."))
    s += [
        f"In spring the water of the {n} is high because of the melting snow.",
        _pick(rng, "Small boats can travel on the lower part of the river.", f"Fishing on the {n} is popular in summer."),
    ]
    return _drop_some(s, rng, keep_first=2)


def _person_doc(p: dict, rng: random.Random) -> list[str]:
    n, he = p["name"], ("she" if p["she"] else "he")
    his = "her" if p["she"] else "his"
    works, verb, obj = _PROFESSIONS[p["profession"]]
    surname = n.split()[-1]
    s = [
        f"{n} ({p['born']} to {p['died']}) was {_article(p['profession'])} {p['profession']} from {p['city']['country']['name']}.",
        f"{_capitalize(he)} was born in the city of {p['city']['name']}.",
        _pick(rng, f"As a young person, {he} studied in {p['work_city']['name']}.",
              f"{_capitalize(his)} family moved to {p['work_city']['name']} when {he} was a child."),
        f"{surname} is best known for {his} {works}.",
        f"In {p['born'] + rng.randint(22, 34)}, {he} {verb} {obj} {p['work_city']['name']}.",
        _pick(rng, f"This work made {surname} famous across {p['work_city']['country']['name']}.",
              f"Many people in {p['work_city']['name']} still remember {his} work."),
        f"Later in life {he} returned to {p['city']['name']}, where {he} died in {p['died']}.",
        f"A street in {p['city']['name']} is named after {surname}.",
    ]
    return _drop_some(s, rng, keep_first=2)


def _company_doc(c: dict, rng: random.Random) -> list[str]:
    n, city, founder = c["name"], c["city"], c["founder"]
    s = [
        f"{n} is a company that makes {c['product']}.",
        f"It was founded in {c['founded']} in {city['name']}, {city['country']['name']}.",
        f"The founder of the company was {founder['name']}, a former {founder['profession']}.",
        _pick(rng, f"Today {n} has about {c['workers']:,} workers.", f"The company employs about {c['workers']:,} people."),
        f"Its first factory stood near the river {city['river']['name']}.",
        _pick(rng, f"The {c['product']} made by {n} are sold in many countries.",
              f"Most of its {c['product']} are sold in {city['country']['name']}."),
        f"The main office of the company is still in {city['name']}.",
    ]
    return _drop_some(s, rng, keep_first=2)


def _animal_doc(a: dict, rng: random.Random) -> list[str]:
    n, kind = a["name"], a["kind"]
    habit, food, home = _ANIMAL_KINDS[kind]
    s = [
        f"The {n} {kind} is an animal that lives in the {a['habitat']} of {a['country']['name']}.",
        f"Its body is {a['color']} and about {a['size']} centimeters long.",
        f"The {n} {kind} {habit}.",
        f"It eats mostly {food}.",
        f"It {home}.",
        _pick(rng, f"The {n} {kind} is rare, and it is protected by law in {a['country']['name']}.",
              f"It is common in the {a['country']['mountains']}."),
    ]
    return _drop_some(s, rng, keep_first=2)


def _drop_some(sentences: list[str], rng: random.Random, keep_first: int) -> list[str]:
    # Skip a few later sentences so documents about one entity differ, keeping the order.
    return sentences[:keep_first] + [x for x in sentences[keep_first:] if rng.random() < 0.85]


def generate_documents(num_documents: int = 2000, seed: int = 0) -> list[list[str]]:
    """Documents as lists of sentences (deterministic in ``seed``)."""
    rng = random.Random(f"tempo-sample-corpus:{seed}")
    world = _build_world(rng)
    kinds = [("cities", _city_doc, 4), ("people", _person_doc, 3), ("rivers", _river_doc, 1),
             ("companies", _company_doc, 2), ("animals", _animal_doc, 2)]
    weights = [k[2] for k in kinds]
    docs = []
    for _ in range(num_documents):
        key, make, _w = rng.choices(kinds, weights=weights)[0]
        docs.append(make(rng.choice(world[key]), rng))
    return docs


def write_sample_corpus(out_dir: str | os.PathLike, num_documents: int = 2000, seed: int = 0,
                        num_files: int = 4) -> list[Path]:
    """Write the corpus as ``num_files`` text files in DLE layout; returns their paths.

    2000 documents are about 0.75 MB of text. Files are written atomically.
    """
    if num_documents < 1 or num_files < 1:
        raise ValueError("num_documents and num_files must be >= 1")
    docs = generate_documents(num_documents, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    num_files = min(num_files, num_documents)
    paths = []
    for k in range(num_files):
        part = docs[k::num_files]
        path = out_dir / f"sample_corpus_{k:02d}.txt"
        atomic_write_text(path, "\n\n".join("\n".join(doc) for doc in part) + "\n")
        paths.append(path)
    return paths
