"""Canary prompts: PII sentence templates filled with synthetic identities.

The mirror's ``pii/`` folder (from ``presidio-evaluator``) holds 209 templates with
``{{placeholders}}`` and 3,000 FakeNameGenerator identities. A canary prompt is a template
that names a person or holds structured PII, filled from one identity; its *canaries* are
the private values put in (full name, surname, e-mail, phone, card number, national id,
street address, date of birth, IBAN). A canary found in an outbound payload — as text or as
the tokens of that text — is a leak (:mod:`edgefuse.privacy.audit`).
"""

from __future__ import annotations

import csv
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

# placeholders whose value is a canary (private); the rest are filled but not scanned for
_PRIVATE = {"person", "name", "name_female", "name_male", "first_name", "last_name",
            "first_name_male", "first_name_female", "last_name_male", "last_name_female",
            "first_name_nonbinary", "email", "phone_number", "credit_card_number", "ssn",
            "address", "street_name", "date_of_birth", "iban", "us_driver_license"}
STRUCTURED_KINDS = frozenset({"email", "phone_number", "credit_card_number", "ssn", "address",
                              "date_of_birth", "iban", "us_driver_license"})
"""Canary kinds of structured PII (pattern recognizers catch them; a street alone is not one)."""
_STRUCTURED = STRUCTURED_KINDS
_NAMES = {"person", "name", "name_female", "name_male"}
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


@dataclass
class CanaryPrompt:
    """One filled template. ``text``: the prompt; ``canaries``: private values it contains
    (each ≥ 4 characters, so a scan never matches a short common string); ``kinds``: the
    placeholder kind of each canary."""
    text: str
    canaries: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)


def _pii_dir(mirror: str | Path | None) -> Path:
    if mirror is None:
        raise FileNotFoundError("canary prompts need the data mirror (data.mirror / "
                                "EDGEFUSE_DATA_MIRROR) with pii/templates.txt")
    d = Path(mirror) / "pii"
    if not (d / "templates.txt").is_file():
        raise FileNotFoundError(f"no PII templates at {d / 'templates.txt'}: point data.mirror at "
                                "the offline mirror (../shared/data)")
    return d


def _luhn_card(rng: random.Random) -> str:
    """A 16-digit Luhn-valid card number (Visa-like prefix 4), grouped by 4."""
    digits = [4] + [rng.randrange(10) for _ in range(14)]
    total = 0
    for i, d in enumerate(reversed(digits)):  # the check digit will sit right of these
        d2 = d * 2 if i % 2 == 0 else d
        total += d2 - 9 if d2 > 9 else d2
    digits.append((10 - total % 10) % 10)
    s = "".join(map(str, digits))
    return " ".join(s[i:i + 4] for i in range(0, 16, 4))


def _iban(rng: random.Random) -> str:
    """A German-format IBAN with a valid ISO 7064 mod-97 check."""
    bban = "".join(str(rng.randrange(10)) for _ in range(18))
    num = int(bban + "131400")  # D=13 E=14, check digits 00
    check = 98 - num % 97
    return f"DE{check:02d}{bban}"


def _values(row: dict, rng: random.Random) -> dict[str, str]:
    first, last = row["GivenName"].strip(), row["Surname"].strip()
    ssn = row.get("NationalID", "").strip() or (
        f"{rng.randrange(100, 900):03d}-{rng.randrange(10, 100):02d}-{rng.randrange(1000, 10000):04d}")
    street = row["StreetAddress"].strip()
    return {
        "person": f"{first} {last}", "name": f"{first} {last}", "name_female": f"{first} {last}",
        "name_male": f"{first} {last}", "first_name": first, "first_name_male": first,
        "first_name_female": first, "first_name_nonbinary": first, "last_name": last,
        "last_name_male": last, "last_name_female": last,
        "email": row["EmailAddress"].strip(),
        "phone_number": f"+{row['TelephoneCountryCode'].strip()} {row['TelephoneNumber'].strip()}",
        "credit_card_number": _luhn_card(rng), "ssn": ssn, "iban": _iban(rng),
        "address": f"{street}, {row['City'].strip()} {row['ZipCode'].strip()}",
        "street_name": street, "building_number": str(rng.randrange(1, 300)),
        "secondary_address": f"Apt. {rng.randrange(1, 90)}",
        "date_of_birth": row["Birthday"].strip(), "date_time": row["Birthday"].strip(),
        "city": row["City"].strip(), "country": row["CountryFull"].strip(),
        "nationality": row["CountryFull"].strip(), "nation_woman": row["CountryFull"].strip(),
        "nation_plural": row["CountryFull"].strip(), "state_abbr": row["State"].strip(),
        "postcode": row["ZipCode"].strip(), "zipcode": row["ZipCode"].strip(),
        "organization": row["Company"].strip(), "job": row["Occupation"].strip(),
        "age": row["Age"].strip(), "year": str(rng.randrange(1950, 2020)),
        "url": f"https://{row['Domain'].strip()}", "ip_address": ".".join(
            str(rng.randrange(1, 255)) for _ in range(4)),
        "us_driver_license": f"{rng.choice('ABCDEFGH')}{rng.randrange(10**6, 10**7)}",
        "prefix": row["Title"].strip(), "prefix_male": "Mr.", "prefix_female": "Ms.",
        "day_of_week": rng.choice(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]),
    }


def load_canary_prompts(mirror: str | Path | None, n: int, seed: int) -> list[CanaryPrompt]:
    """``n`` canary prompts, drawn by ``seed`` (deterministic).

    Templates are those with at least one private placeholder that is a full name or
    structured PII; each is filled from a different identity of the CSV (card numbers and
    IBANs are generated valid, since the CSV's are in float notation). A template whose
    placeholders this module cannot fill is skipped.

    Raises:
        FileNotFoundError: no ``pii/`` folder under ``mirror``.
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"need at least one canary prompt, got n={n}")
    d = _pii_dir(mirror)
    templates = [t.strip().replace("\\n", "\n")  # the file writes a template's line breaks as \n
                 for t in (d / "templates.txt").read_text(encoding="utf-8", errors="replace").splitlines()]
    with open(d / "FakeNameGenerator.com_3000.csv", encoding="utf-8-sig", newline="") as f:
        rows = list(csv.DictReader(f))
    rng = random.Random(seed)
    usable = [t for t in templates if t and "\ufffd" not in t
              and set(_PLACEHOLDER.findall(t)) & (_STRUCTURED | _NAMES)]
    rng.shuffle(usable)
    rng.shuffle(rows)
    out: list[CanaryPrompt] = []
    for i in range(n):
        template, row = usable[i % len(usable)], rows[i % len(rows)]
        vals = _values(row, rng)
        kinds = _PLACEHOLDER.findall(template)
        if any(k not in vals for k in kinds):
            continue
        text = _PLACEHOLDER.sub(lambda m: vals[m.group(1)], template)
        canaries, ck = [], []
        for k in dict.fromkeys(kinds):
            if k in _PRIVATE and len(vals[k]) >= 4 and vals[k] not in canaries:
                canaries.append(vals[k])
                ck.append(k)
            if k in _NAMES:  # a surname alone is identifying too
                last = vals[k].split()[-1]
                if len(last) >= 4 and last not in canaries:
                    canaries.append(last)
                    ck.append("last_name")
        out.append(CanaryPrompt(text, canaries, ck))
    return out
