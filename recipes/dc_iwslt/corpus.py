"""The recipe's three corpora, and ``load_translation_data`` that picks one (``data=...``).

- ``phrases`` (the embedded default; no download): a German↔English parallel corpus generated from a
  fixed lexicon and templates with num2words, e.g. "ich habe drei rote äpfel ." ↔ "i have three red
  apples .", "ich wurde am dritten märz neunzehnhundertneunundneunzig geboren ." ↔ "i was born on the
  third of march nineteen ninety-nine .". German grammar is carried through (verb conjugation,
  article and adjective endings by gender, case and number, verb-final participles, verb-subject
  inversion in questions), so the model has real agreement and reordering to learn; each source has
  one translation. Lowercased, word-level tokens (punctuation separate, hyphenated numbers one
  token), no BPE. Pairs are unique on both sides, so test sentences never occur in training.
- ``iwslt14``: what ``scripts/prepare_iwslt14.py`` wrote into ``data.root`` (or a fairseq data-bin
  directory there).
- ``fake``: random token ids with IWSLT'14-like lengths and the report's dictionary sizes (8,848 de /
  6,632 en), for profiling the report's model at 4,000-token batches without the data set.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from num2words import num2words

from lowmem.config import ConfigError
from recipes.dc_iwslt.data import (
    EOS,
    DataUnavailableError,
    Dictionary,
    ParallelCorpus,
    TokenSequences,
    read_fairseq_indexed,
    read_token_file,
    token_file_paths,
)

DATA_NAMES = ("phrases", "iwslt14", "fake")
SPLITS = ("train", "valid", "test")
GENERATED_PAIRS = (("de", "en"), ("en", "de"))  # the language pairs of `phrases` and `fake`

Phrase = tuple[list[str], list[str]]  # German tokens, English tokens


@dataclass(frozen=True)
class TranslationData:
    """One corpus, ready for batching: dictionaries and the three splits (source → target)."""

    name: str
    src_lang: str
    tgt_lang: str
    src_dict: Dictionary
    tgt_dict: Dictionary
    train: ParallelCorpus
    valid: ParallelCorpus
    test: ParallelCorpus

    @property
    def description(self) -> str:
        """One line for the log: corpus, direction, sizes."""
        return (
            f"{self.name} {self.src_lang}→{self.tgt_lang}: {len(self.train):,} train / {len(self.valid):,} "
            f"valid / {len(self.test):,} test pairs, dictionaries {len(self.src_dict):,} "
            f"({self.src_lang}) and {len(self.tgt_dict):,} ({self.tgt_lang}) types"
        )


def load_translation_data(
    name: str,
    root: str | Path | None = None,
    src_lang: str = "de",
    tgt_lang: str = "en",
    *,
    seed: int = 0,
    size: int | None = None,
    test_size: int | None = None,
) -> TranslationData:
    """The corpus ``name`` (one of ``DATA_NAMES``) in the direction ``src_lang`` → ``tgt_lang``.

    ``root`` is the data directory (``data.root``; read by ``iwslt14`` only). ``seed``, ``size``
    (training pairs, ``data.train_size``) and ``test_size`` (``data.test_size``) shape the generated
    corpora; ``None`` takes the defaults: 28,500 / 500 valid / 1,000 test pairs for ``phrases``,
    160,239 / 200 / 200 for ``fake``.
    """
    if name not in DATA_NAMES:
        raise ConfigError(
            f"data={name!r} is unknown for the dc_iwslt recipe; choose one of {', '.join(DATA_NAMES)}"
        )
    if name == "iwslt14":
        return _load_prepared(Path(root if root is not None else "."), src_lang, tgt_lang)
    _check_generated_pair(name, src_lang, tgt_lang)
    if name == "phrases":
        src_dict, tgt_dict, splits = load_phrases_corpus(
            seed,
            size or PHRASES_TRAIN,
            test_size=test_size or PHRASES_TEST,
            src_lang=src_lang,
            tgt_lang=tgt_lang,
        )
    else:
        vocab = {"de": FAKE_SOURCE_VOCAB, "en": FAKE_TARGET_VOCAB}
        src_dict, tgt_dict = fake_dictionary(vocab[src_lang]), fake_dictionary(vocab[tgt_lang])
        sizes = {"train": size or FAKE_TRAIN_PAIRS, "valid": 200, "test": test_size or 200}
        splits = {
            split: make_fake_translation(
                count, len(src_dict), len(tgt_dict), seed=seed + index, source_is_german=src_lang == "de"
            )
            for index, (split, count) in enumerate(sizes.items())
        }
    return TranslationData(name, src_lang, tgt_lang, src_dict, tgt_dict, **splits)


def _check_generated_pair(name: str, src_lang: str, tgt_lang: str) -> None:
    if (src_lang, tgt_lang) not in GENERATED_PAIRS:
        available = ", ".join(f"{s}→{t}" for s, t in GENERATED_PAIRS)
        raise ConfigError(
            f"data.src_lang={src_lang!r} / data.tgt_lang={tgt_lang!r}: data={name} has the language pairs "
            f"{available}"
        )


# --------------------------------------------------------------------------- prepared data (iwslt14)


def _load_prepared(root: Path, src_lang: str, tgt_lang: str) -> TranslationData:
    """Token files written by scripts/prepare_iwslt14.py, else fairseq's data-bin files, from ``root``."""
    pairs = _available_pairs(root)
    if pairs and {src_lang, tgt_lang} not in [set(pair) for pair in pairs]:
        available = ", ".join(f"{a}→{b} or {b}→{a}" for a, b in sorted(pairs))
        raise ConfigError(
            f"data.src_lang={src_lang!r} / data.tgt_lang={tgt_lang!r}: {root} holds the language pairs "
            f"{available}"
        )
    dict_paths = [root / f"dict.{lang}.txt" for lang in (src_lang, tgt_lang)]
    for reader, suffixes in (
        (read_token_file, (".tokens.npy", ".offsets.npy")),
        (read_fairseq_indexed, (".bin", ".idx")),
    ):
        prefixes = {
            (split, lang): _split_prefix(root, split, src_lang, tgt_lang, lang, suffixes)
            for split in SPLITS
            for lang in (src_lang, tgt_lang)
        }
        if all(prefixes.values()) and all(path.is_file() for path in dict_paths):
            splits = {
                split: ParallelCorpus(reader(prefixes[split, src_lang]), reader(prefixes[split, tgt_lang]))
                for split in SPLITS
            }
            src_dict, tgt_dict = (Dictionary.load(path) for path in dict_paths)
            return TranslationData("iwslt14", src_lang, tgt_lang, src_dict, tgt_dict, **splits)
    expected = [path.name for path in dict_paths] + [
        path.name
        for split in SPLITS
        for lang in (src_lang, tgt_lang)
        for path in token_file_paths(root / f"{split}.{src_lang}-{tgt_lang}.{lang}")
    ]
    raise DataUnavailableError(
        f"IWSLT'14 {src_lang}-{tgt_lang} is not prepared in {root.resolve()} (data.root): expected "
        f"{', '.join(expected)} (or fairseq data-bin files like train.{src_lang}-{tgt_lang}.{src_lang}.bin "
        f"and .idx, with the dict files). Create them with `python scripts/prepare_iwslt14.py --out {root}` "
        f"(downloads ~20 MB once), point data.root at a prepared directory, or train without it: "
        f"data=phrases (the embedded generated German→English corpus) or data=fake (random tokens)."
    )


def _split_prefix(
    root: Path, split: str, src_lang: str, tgt_lang: str, lang: str, suffixes: tuple[str, str]
) -> Path | None:
    """The prefix of a split's files for ``lang``: ``split.src-tgt.lang`` or, for the reverse
    direction of prepared data, ``split.tgt-src.lang`` (as fairseq looks them up)."""
    for pair in (f"{src_lang}-{tgt_lang}", f"{tgt_lang}-{src_lang}"):
        prefix = root / f"{split}.{pair}.{lang}"
        if all(Path(f"{prefix}{suffix}").is_file() for suffix in suffixes):
            return prefix
    return None


def _available_pairs(root: Path) -> set[tuple[str, str]]:
    """Language pairs with training files in ``root`` (ours or fairseq's)."""
    pattern = re.compile(r"^train\.([^.\-]+)-([^.\-]+)\.[^.]+\.(tokens\.npy|idx)$")
    if not root.is_dir():
        return set()
    return {match.groups()[:2] for path in root.iterdir() if (match := pattern.match(path.name))}


# ------------------------------------------------------------------------------------ fake data

FAKE_SOURCE_VOCAB, FAKE_TARGET_VOCAB = 8848, 6632  # the report's IWSLT'14 dictionaries (de, en)
# IWSLT'14 de-en training sentences after the standard preparation average ~24 German and ~23 English
# tokens (BPE, </s> included) with a long tail cut at 175. Lengths are drawn lognormal with those
# means; sigma 0.6 (a coefficient of variation of 0.66, as sentence lengths typically have) puts ~0.02%
# of draws above the cap, where they are clipped. Source and target log-lengths correlate at 0.9.
# The training split has IWSLT'14's 160,239 pairs by default, so its 4,000-token batches look like
# the real ones: batches are cut from pairs sorted by source then target length, and only a corpus
# that large has enough pairs per source length for the targets of a batch to be of similar length
# (2,000 pairs gave batches of ~2,000 real target tokens padded to ~4,000). Here: ~1,100 batches an
# epoch, a median of 121 pairs and ~3,550 real target tokens per batch (generation takes ~0.1 s).
FAKE_TRAIN_PAIRS = 160_239
FAKE_MEAN_TOKENS = {"de": 24.0, "en": 23.0}
FAKE_LENGTH_SIGMA = 0.6
FAKE_LENGTH_CORRELATION = 0.9
FAKE_MAX_TOKENS = 175


def fake_dictionary(size: int) -> Dictionary:
    """A dictionary of exactly ``size`` symbols: the 4 special ones, then ``w4``, ``w5``, ..."""
    dictionary = Dictionary()
    for index in range(dictionary.nspecial, size):
        dictionary.add_symbol(f"w{index}", 1)
    return dictionary


def make_fake_translation(
    num_sentences: int,
    src_vocab: int = FAKE_SOURCE_VOCAB,
    tgt_vocab: int = FAKE_TARGET_VOCAB,
    *,
    seed: int = 0,
    source_is_german: bool = True,
) -> ParallelCorpus:
    """Random sentence pairs with IWSLT'14 de-en-like lengths (see ``FAKE_MEAN_TOKENS``).

    Token ids are uniform over the non-special ids of each vocabulary; every sentence ends with
    ``</s>`` and holds 2 to 175 tokens.
    """
    rng = np.random.default_rng(seed)
    shared = rng.standard_normal(num_sentences)
    own = rng.standard_normal(num_sentences)
    correlated = FAKE_LENGTH_CORRELATION * shared + np.sqrt(1 - FAKE_LENGTH_CORRELATION**2) * own
    source_lang, target_lang = ("de", "en") if source_is_german else ("en", "de")
    sides = []
    for lang, normal, vocab in ((source_lang, shared, src_vocab), (target_lang, correlated, tgt_vocab)):
        mu = np.log(FAKE_MEAN_TOKENS[lang]) - FAKE_LENGTH_SIGMA**2 / 2  # lognormal mean = exp(mu + s²/2)
        lengths = np.rint(np.exp(mu + FAKE_LENGTH_SIGMA * normal))
        lengths = np.clip(lengths, 2, FAKE_MAX_TOKENS).astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = rng.integers(4, vocab, size=int(offsets[-1])).astype(np.int32)
        tokens[offsets[1:] - 1] = EOS
        sides.append(TokenSequences(tokens, offsets))
    return ParallelCorpus(*sides)


# ------------------------------------------------------------------------------- phrases: lexicon

PHRASES_TRAIN, PHRASES_VALID, PHRASES_TEST = 28_500, 500, 1_000  # 30,000 pairs in all


class Pronoun(NamedTuple):
    german: str
    english: str
    person: int  # index into the verb tables: ich, du, er/sie/es, wir, ihr, sie


class Verb(NamedTuple):
    german: tuple[str, str, str, str, str, str]  # present, by person
    participle: str
    english: str  # base form
    english_third: str  # he/she ...
    english_past: str


class Noun(NamedTuple):
    german: str
    german_plural: str
    gender: str  # "m", "f", "n"
    english: str
    english_plural: str


PRONOUNS = (
    Pronoun("ich", "i", 0),
    Pronoun("du", "you", 1),
    Pronoun("er", "he", 2),
    Pronoun("sie", "she", 2),
    Pronoun("wir", "we", 3),
    Pronoun("ihr", "you", 4),
    Pronoun("sie", "they", 5),
)


def _regular(stem: str, participle: str, english: str, third: str, past: str, *, e: str = "") -> Verb:
    """A regular German present tense; ``e`` is the linking vowel of stems like find-e-st."""
    forms = (f"{stem}e", f"{stem}{e}st", f"{stem}{e}t", f"{stem}en", f"{stem}{e}t", f"{stem}en")
    return Verb(forms, participle, english, third, past)


VERBS = (
    Verb(("habe", "hast", "hat", "haben", "habt", "haben"), "gehabt", "have", "has", "had"),
    Verb(("sehe", "siehst", "sieht", "sehen", "seht", "sehen"), "gesehen", "see", "sees", "saw"),
    Verb(("mag", "magst", "mag", "mögen", "mögt", "mögen"), "gemocht", "like", "likes", "liked"),
    Verb(
        ("trage", "trägst", "trägt", "tragen", "tragt", "tragen"), "getragen", "carry", "carries", "carried"
    ),
    _regular("kauf", "gekauft", "buy", "buys", "bought"),
    _regular("verkauf", "verkauft", "sell", "sells", "sold"),
    _regular("brauch", "gebraucht", "need", "needs", "needed"),
    _regular("find", "gefunden", "find", "finds", "found", e="e"),
    _regular("mal", "gemalt", "paint", "paints", "painted"),
    _regular("zähl", "gezählt", "count", "counts", "counted"),
    Verb(
        ("wasche", "wäschst", "wäscht", "waschen", "wascht", "waschen"),
        "gewaschen",
        "wash",
        "washes",
        "washed",
    ),
)
HABEN = VERBS[0]

NOUNS = tuple(
    Noun(*fields.split())
    for fields in (
        "apfel äpfel m apple apples",
        "birne birnen f pear pears",
        "buch bücher n book books",
        "haus häuser n house houses",
        "hund hunde m dog dogs",
        "katze katzen f cat cats",
        "auto autos n car cars",
        "stuhl stühle m chair chairs",
        "tisch tische m table tables",
        "blume blumen f flower flowers",
        "flasche flaschen f bottle bottles",
        "tasse tassen f cup cups",
        "vogel vögel m bird birds",
        "fahrrad fahrräder n bicycle bicycles",
        "brief briefe m letter letters",
        "lampe lampen f lamp lamps",
        "schiff schiffe n ship ships",
        "baum bäume m tree trees",
        "kind kinder n child children",
        "tomate tomaten f tomato tomatoes",
        "hut hüte m hat hats",
        "tür türen f door doors",
        "bild bilder n picture pictures",
        "schlüssel schlüssel m key keys",
    )
)

# (German stem that takes the endings, English); "teuer" loses its e before an ending.
ADJECTIVES = (
    ("rot", "red"),
    ("grün", "green"),
    ("blau", "blue"),
    ("gelb", "yellow"),
    ("schwarz", "black"),
    ("weiß", "white"),
    ("groß", "big"),
    ("klein", "small"),
    ("alt", "old"),
    ("neu", "new"),
    ("schön", "beautiful"),
    ("teur", "expensive"),
    ("billig", "cheap"),
    ("schwer", "heavy"),
)

# Articles and adjective endings by (determiner, case) and slot (gender, or "pl").
ARTICLES = {
    ("definite", "nom"): {"m": "der", "f": "die", "n": "das", "pl": "die"},
    ("definite", "acc"): {"m": "den", "f": "die", "n": "das", "pl": "die"},
    ("definite", "dat"): {"m": "dem", "f": "der", "n": "dem", "pl": "den"},
    ("indefinite", "acc"): {"m": "einen", "f": "eine", "n": "ein"},
    ("kein", "acc"): {"pl": "keine"},
}
ENDINGS = {
    ("definite", "nom"): {"m": "e", "f": "e", "n": "e", "pl": "en"},
    ("definite", "acc"): {"m": "en", "f": "e", "n": "e", "pl": "en"},
    ("definite", "dat"): {"m": "en", "f": "en", "n": "en", "pl": "en"},
    ("indefinite", "acc"): {"m": "en", "f": "e", "n": "es"},
    ("kein", "acc"): {"pl": "en"},
    ("number", "acc"): {"pl": "e"},  # no article: strong endings ("drei rote äpfel")
}

PREPOSITIONS = (
    ("auf", "on"),
    ("unter", "under"),
    ("neben", "next to"),
    ("hinter", "behind"),
    ("vor", "in front of"),
)
MONTHS = tuple(
    zip(
        ("januar februar märz april mai juni juli august september oktober november dezember").split(),
        ("january february march april may june july august september october november december").split(),
        (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31),
        strict=True,
    )
)
EVENTS = (
    ("das konzert", "the concert"),
    ("die party", "the party"),
    ("das treffen", "the meeting"),
    ("die hochzeit", "the wedding"),
    ("das spiel", "the game"),
    ("die prüfung", "the exam"),
    ("der termin", "the appointment"),
    ("das fest", "the festival"),
)
WURDE = ("wurde", "wurdest", "wurde", "wurden", "wurdet", "wurden")  # "was born", by person
WAS = ("was", "were", "was", "were", "were", "were")
SCHEDULE = (
    ("der zug fährt", "the train leaves"),
    ("der bus kommt", "the bus arrives"),
    ("der film beginnt", "the film starts"),
    ("das konzert beginnt", "the concert starts"),
    ("der unterricht endet", "the lesson ends"),
    ("wir essen", "we eat"),
    ("das geschäft öffnet", "the shop opens"),
    ("das geschäft schließt", "the shop closes"),
    ("ich komme", "i come"),
    ("sie kommen", "they come"),
)
# Units: German singular, plural, gender; English singular, plural; what they measure.
SOLIDS = (
    ("äpfel", "apples"),
    ("tomaten", "tomatoes"),
    ("kartoffeln", "potatoes"),
    ("reis", "rice"),
    ("zucker", "sugar"),
    ("mehl", "flour"),
    ("käse", "cheese"),
    ("kaffee", "coffee"),
    ("nudeln", "pasta"),
)
LIQUIDS = (
    ("milch", "milk"),
    ("wasser", "water"),
    ("saft", "juice"),
    ("wein", "wine"),
    ("öl", "oil"),
    ("bier", "beer"),
)
UNITS = (
    ("kilo", "kilo", "n", "kilo", "kilos", SOLIDS),
    ("packung", "packungen", "f", "packet", "packets", SOLIDS),
    ("liter", "liter", "m", "liter", "liters", LIQUIDS),
    ("flasche", "flaschen", "f", "bottle", "bottles", LIQUIDS),
)
OPERATORS = (("plus", "plus"), ("minus", "minus"), ("mal", "times"))


@functools.cache
def number(value: int, lang: str, to: str = "cardinal") -> str:
    """num2words, cached (a call costs ~0.1 ms); multi-word English results stay one string."""
    return num2words(value, lang=lang, to=to)


# ----------------------------------------------------------------------------- phrases: templates


def _pick(rng: np.random.RandomState, items: tuple):
    return items[int(rng.rand() * len(items))]  # rand() costs a tenth of randint()


def _german_noun_phrase(
    noun: Noun, adjective: str | None, determiner: str, case: str, plural: bool, count: int = 0
) -> list[str]:
    slot = "pl" if plural else noun.gender
    words = [number(count, "de")] if determiner == "number" else [ARTICLES[determiner, case][slot]]
    if adjective:
        words.append(adjective + ENDINGS[determiner, case][slot])
    if not plural:
        words.append(noun.german)
    elif case == "dat" and not noun.german_plural.endswith(("n", "s")):
        words.append(noun.german_plural + "n")  # dative plural: "den tischen"
    else:
        words.append(noun.german_plural)
    return words


def _english_noun_phrase(
    noun: Noun, adjective: str | None, determiner: str, plural: bool, count: int = 0
) -> list[str]:
    words = [adjective] if adjective else []
    words.append(noun.english_plural if plural else noun.english)
    if determiner == "number":
        return [number(count, "en"), *words]
    if determiner == "indefinite":
        return ["an" if words[0][0] in "aeiou" else "a", *words]
    if determiner == "kein":
        return ["any", *words]
    return ["the", *words]


def _object(rng: np.random.RandomState) -> tuple[list[str], list[str]]:
    """An accusative object: a number of things, a thing, or the thing(s), with or without adjective."""
    noun = _pick(rng, NOUNS)
    german_adjective, english_adjective = _pick(rng, ADJECTIVES) if rng.rand() < 0.6 else (None, None)
    roll = rng.rand()
    if roll < 0.55:
        count = rng.randint(2, 21) if rng.rand() < 0.6 else rng.randint(21, 100)
        return (
            _german_noun_phrase(noun, german_adjective, "number", "acc", True, count),
            _english_noun_phrase(noun, english_adjective, "number", True, count),
        )
    determiner, plural = ("indefinite", False) if roll < 0.85 else ("definite", rng.rand() < 0.5)
    return (
        _german_noun_phrase(noun, german_adjective, determiner, "acc", plural),
        _english_noun_phrase(noun, english_adjective, determiner, plural),
    )


def _english_present(verb: Verb, person: int) -> str:
    return verb.english_third if person == 2 else verb.english


def present(rng: np.random.RandomState) -> Phrase:
    """ "wir kaufen zwölf kleine bücher ." ↔ "we buy twelve small books ." """
    subject, verb = _pick(rng, PRONOUNS), _pick(rng, VERBS)
    german, english = _object(rng)
    return (
        [subject.german, verb.german[subject.person], *german, "."],
        [subject.english, _english_present(verb, subject.person), *english, "."],
    )


def perfect(rng: np.random.RandomState) -> Phrase:
    """ "er hat gestern einen alten hund gesehen ." ↔ "he saw an old dog yesterday ." """
    subject, verb = _pick(rng, PRONOUNS), _pick(rng, VERBS)
    german, english = _object(rng)
    return (
        [subject.german, HABEN.german[subject.person], "gestern", *german, verb.participle, "."],
        [subject.english, verb.english_past, *english, "yesterday", "."],
    )


def negation(rng: np.random.RandomState) -> Phrase:
    """ "ich habe keine roten äpfel ." ↔ "i do not have any red apples ." """
    subject, verb, noun = _pick(rng, PRONOUNS), _pick(rng, VERBS), _pick(rng, NOUNS)
    german_adjective, english_adjective = _pick(rng, ADJECTIVES) if rng.rand() < 0.5 else (None, None)
    auxiliary = "does" if subject.person == 2 else "do"
    return (
        [
            subject.german,
            verb.german[subject.person],
            *_german_noun_phrase(noun, german_adjective, "kein", "acc", True),
            ".",
        ],
        [
            subject.english,
            auxiliary,
            "not",
            verb.english,
            *_english_noun_phrase(noun, english_adjective, "kein", True),
            ".",
        ],
    )


def question(rng: np.random.RandomState) -> Phrase:
    """ "wie viele rote äpfel kauft er ?" ↔ "how many red apples does he buy ?" """
    subject, verb, noun = _pick(rng, PRONOUNS), _pick(rng, VERBS), _pick(rng, NOUNS)
    german_adjective, english_adjective = _pick(rng, ADJECTIVES) if rng.rand() < 0.5 else (None, None)
    german = ["wie", "viele", *([german_adjective + "e"] if german_adjective else []), noun.german_plural]
    english = ["how", "many", *([english_adjective] if english_adjective else []), noun.english_plural]
    auxiliary = "does" if subject.person == 2 else "do"
    return (
        [*german, verb.german[subject.person], subject.german, "?"],
        [*english, auxiliary, subject.english, verb.english, "?"],
    )


def location(rng: np.random.RandomState) -> Phrase:
    """ "die kleinen katzen sind unter dem alten tisch ." ↔ "the small cats are under the old table ." """
    phrases = []
    for case in ("nom", "dat"):
        noun, plural = _pick(rng, NOUNS), rng.rand() < 0.3
        german_adjective, english_adjective = _pick(rng, ADJECTIVES) if rng.rand() < 0.5 else (None, None)
        phrases.append(
            (
                _german_noun_phrase(noun, german_adjective, "definite", case, plural),
                _english_noun_phrase(noun, english_adjective, "definite", plural),
                plural,
            )
        )
    (german_subject, english_subject, plural), (german_place, english_place, _) = phrases
    preposition = _pick(rng, PREPOSITIONS)
    return (
        [*german_subject, "sind" if plural else "ist", preposition[0], *german_place, "."],
        [*english_subject, "are" if plural else "is", *preposition[1].split(), *english_place, "."],
    )


def date(rng: np.random.RandomState) -> Phrase:
    """ "am dritten märz neunzehnhundertneunundneunzig" ↔ "on the third of march nineteen ninety-nine",
    after an event or in "... wurde am ... geboren" ↔ "... was born on ..."."""
    german_month, english_month, days = _pick(rng, MONTHS)
    day = rng.randint(1, days + 1)
    german = ["am", number(day, "de", "ordinal") + "n", german_month]  # dative: "am dritten"
    english = ["on", "the", number(day, "en", "ordinal"), "of", english_month]
    if rng.rand() < 0.8:
        year = rng.randint(1900, 2031)
        german.append(number(year, "de", "year"))
        english.extend(number(year, "en", "year").split())
    if rng.rand() < 0.5:
        german_event, english_event = _pick(rng, EVENTS)
        return [*german_event.split(), "ist", *german, "."], [*english_event.split(), "is", *english, "."]
    subject = _pick(rng, PRONOUNS)
    return (
        [subject.german, WURDE[subject.person], *german, "geboren", "."],
        [subject.english, WAS[subject.person], "born", *english, "."],
    )


def clock_time(rng: np.random.RandomState) -> Phrase:
    """ "der zug fährt um sieben uhr dreißig ." ↔ "the train leaves at seven thirty ." """
    german_subject, english_subject = _pick(rng, SCHEDULE)
    hour, minute = rng.randint(1, 13), 5 * rng.randint(12)
    german = ["um", "ein" if hour == 1 else number(hour, "de"), "uhr"]  # "ein uhr", not "eins uhr"
    english = ["at", number(hour, "en")]
    if minute == 0:
        english.append("o'clock")
    else:
        german.append(number(minute, "de"))
        english.extend(["oh", "five"] if minute == 5 else [number(minute, "en")])
    return [*german_subject.split(), *german, "."], [*english_subject.split(), *english, "."]


def arithmetic(rng: np.random.RandomState) -> Phrase:
    """ "sieben mal acht ist sechsundfünfzig ." ↔ "seven times eight is fifty-six ." """
    german_operator, english_operator = _pick(rng, OPERATORS)
    if german_operator == "mal":
        a, b = rng.randint(0, 13), rng.randint(0, 13)
        result = a * b
    elif german_operator == "plus":
        a, b = rng.randint(0, 51), rng.randint(0, 51)
        result = a + b
    else:
        a = rng.randint(0, 100)
        b = rng.randint(0, a + 1)
        result = a - b
    return (
        [number(a, "de"), german_operator, number(b, "de"), "ist", number(result, "de"), "."],
        [
            *number(a, "en").split(),
            english_operator,
            *number(b, "en").split(),
            "is",
            *number(result, "en").split(),
            ".",
        ],
    )


def price(rng: np.random.RandomState) -> Phrase:
    """ "drei flaschen wein kosten zwölf euro ." ↔ "three bottles of wine cost twelve euros ." """
    german_unit, german_units, gender, english_unit, english_units, goods = _pick(rng, UNITS)
    german_good, english_good = _pick(rng, goods)
    count, cost = rng.randint(1, 11), rng.randint(1, 21)
    if count == 1:
        german = [{"m": "ein", "f": "eine", "n": "ein"}[gender], german_unit, german_good, "kostet"]
        english = ["one", english_unit, "of", english_good, "costs"]
    else:
        german = [number(count, "de"), german_units, german_good, "kosten"]
        english = [number(count, "en"), english_units, "of", english_good, "cost"]
    german += ["ein" if cost == 1 else number(cost, "de"), "euro", "."]
    english += [number(cost, "en"), "euro" if cost == 1 else "euros", "."]
    return german, english


# Templates and their shares of the corpus.
TEMPLATES: tuple[tuple[Callable[[np.random.RandomState], Phrase], float], ...] = (
    (present, 0.20),
    (perfect, 0.12),
    (negation, 0.08),
    (question, 0.10),
    (location, 0.14),
    (date, 0.12),
    (clock_time, 0.08),
    (arithmetic, 0.08),
    (price, 0.08),
)


def generate_phrase_pairs(seed: int = 0, size: int = 30_000) -> list[tuple[str, str]]:
    """``size`` distinct (German, English) sentence pairs, a function of ``seed`` alone.

    A pair is kept only if neither side occurred before, so splits of the list share no sentence.
    NumPy's legacy ``RandomState`` is used because its streams are frozen across NumPy versions.
    """
    rng = np.random.RandomState(seed)
    cumulative = np.cumsum([weight for _, weight in TEMPLATES])
    cumulative /= cumulative[-1]
    pairs: list[tuple[str, str]] = []
    seen_german: set[str] = set()
    seen_english: set[str] = set()
    for _ in range(50 * size):  # the template space is far larger than any size asked for
        if len(pairs) == size:
            return pairs
        template = TEMPLATES[int(np.searchsorted(cumulative, rng.rand(), side="right"))][0]
        german_tokens, english_tokens = template(rng)
        german, english = " ".join(german_tokens), " ".join(english_tokens)
        if german not in seen_german and english not in seen_english:
            seen_german.add(german)
            seen_english.add(english)
            pairs.append((german, english))
    raise RuntimeError(f"could only generate {len(pairs)} distinct phrase pairs of {size} asked for")


def load_phrases_corpus(
    seed: int = 0,
    size: int = PHRASES_TRAIN,
    *,
    valid_size: int = PHRASES_VALID,
    test_size: int = PHRASES_TEST,
    src_lang: str = "de",
    tgt_lang: str = "en",
) -> tuple[Dictionary, Dictionary, dict[str, ParallelCorpus]]:
    """The generated corpus as (source dictionary, target dictionary, {"train", "valid", "test"}).

    ``size`` + ``valid_size`` + ``test_size`` pairs are generated; a seeded permutation assigns them
    to test, valid and train (``size`` pairs). Dictionaries are built from the training split
    (fairseq's conventions, sizes padded to a multiple of 8); a word seen only in valid/test maps to
    ``<unk>``.
    """
    _check_generated_pair("phrases", src_lang, tgt_lang)
    if min(size, valid_size, test_size) < 1:
        raise ConfigError(f"data.train_size={size} and data.test_size={test_size} must be positive")
    total = size + valid_size + test_size
    pairs = generate_phrase_pairs(seed, total)
    if src_lang == "en":
        pairs = [(english, german) for german, english in pairs]
    order = np.random.RandomState(seed).permutation(total)
    split_indices = {
        "test": order[:test_size],
        "valid": order[test_size : test_size + valid_size],
        "train": np.sort(order[test_size + valid_size :]),
    }
    src_dict = Dictionary.from_lines(pairs[i][0] for i in split_indices["train"])
    tgt_dict = Dictionary.from_lines(pairs[i][1] for i in split_indices["train"])
    corpus = ParallelCorpus(
        src_dict.encode_lines(source for source, _ in pairs),
        tgt_dict.encode_lines(target for _, target in pairs),
    )
    return src_dict, tgt_dict, {split: corpus.select(indices) for split, indices in split_indices.items()}
