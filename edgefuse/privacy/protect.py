"""Protection of a prompt before it leaves the device: off | redact | rephrase | both.

``redact`` replaces PII with typed placeholders (:mod:`edgefuse.privacy.redact`, Presidio);
``rephrase`` lets the device SLM reword the prompt (:mod:`edgefuse.privacy.rephrase`);
``both`` redacts first and rephrases the redacted text, so the rephraser only ever sees
placeholders. The placeholder -> value mapping stays on the device and
:func:`restore_answer` puts the values back into the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edgefuse.privacy.redact import Redactor, get_redactor, restore
from edgefuse.privacy.rephrase import PLACEHOLDER, rephrase_batch

PROTECTIONS = ("off", "redact", "rephrase", "both")
# Other spellings accepted wherever a protection is configured: the privacy probe's rows
# (results.json ``privacy``) name "off" "none".
PROTECTION_ALIASES = {"none": "off"}
PROTECTION_NAMES = (*PROTECTIONS, *PROTECTION_ALIASES)  # every accepted spelling


@dataclass
class Protected:
    """A protected prompt.

    Attributes:
        text: what is sent off the device.
        mapping: placeholder -> original value (kept on the device; empty unless redacted).
        mode: the protection applied (one of :data:`PROTECTIONS`).
        rephrased_fell_back: True when rephrasing was asked for but its output was
            rejected, so ``text`` is the (redacted) input.
    """

    text: str
    mapping: dict[str, str] = field(default_factory=dict)
    mode: str = "off"
    rephrased_fell_back: bool = False


def check_mode(mode: str) -> str:
    """The protection ``mode`` names: itself if it is one of :data:`PROTECTIONS`, the mode
    an alias stands for if it is one of :data:`PROTECTION_ALIASES` (``none`` → ``off``).

    Raises:
        ValueError: unknown mode; the message lists the valid ones.
    """
    canonical = PROTECTION_ALIASES.get(mode, mode)
    if canonical not in PROTECTIONS:
        raise ValueError(f"unknown privacy protection {mode!r}: use one of "
                         f"{', '.join(PROTECTIONS)} (or {', '.join(PROTECTION_ALIASES)})")
    return canonical


def protect_batch(texts: list[str], mode: str, model=None, tok=None,
                  redactor: Redactor | None = None,
                  max_new_tokens: int = 96, attempts: int = 3) -> list[Protected]:
    """Protect several prompts; rephrasing runs batched on the device SLM.

    Args:
        texts: the prompts.
        mode: ``off`` | ``redact`` | ``rephrase`` | ``both`` (or an alias, :func:`check_mode`).
        model, tok: the device's loaded causal LM and tokenizer (needed for ``rephrase``
            and ``both``).
        redactor: the :class:`Redactor` to use (default: the cached default one; use
            ``Redactor.from_config(cfg)`` for configured settings).
        max_new_tokens: rephrasing budget per prompt.
        attempts: rephrasings tried per prompt at most (``privacy.rephrase.attempts``;
            see :func:`edgefuse.privacy.rephrase.rephrase_batch`).

    Returns:
        one :class:`Protected` per prompt, in order.

    Raises:
        ValueError: unknown mode, or a rephrasing mode without a model and tokenizer.
    """
    mode = check_mode(mode)
    if mode == "off":
        return [Protected(t, {}, mode) for t in texts]
    if mode in ("redact", "both"):
        red = [(redactor or get_redactor()).redact(t) for t in texts]
        out = [Protected(r.text, r.mapping, mode) for r in red]
    else:
        out = [Protected(t, {}, mode) for t in texts]
    if mode in ("rephrase", "both"):
        if model is None or tok is None:
            raise ValueError(f"privacy protection {mode!r} needs the device model and "
                             "tokenizer (model=, tok=)")
        for p, r in zip(out, rephrase_batch(model, tok, [p.text for p in out],
                                            max_new_tokens, attempts=attempts)):
            p.text, p.rephrased_fell_back = r.text, r.fell_back
    return out


def protect(text: str, mode: str, model=None, tok=None, redactor: Redactor | None = None,
            max_new_tokens: int = 96) -> Protected:
    """Protect one prompt; see :func:`protect_batch` (args, errors)."""
    return protect_batch([text], mode, model, tok, redactor, max_new_tokens)[0]


def restore_answer(answer: str, protected: Protected) -> str:
    """Put the original PII values back into an answer to ``protected.text``.

    Tolerates placeholder spellings like ``PERSON_1`` / ``[PERSON_1]`` (see
    :func:`edgefuse.privacy.redact.restore`).
    """
    return restore(answer, protected.mapping)


def join_placeholders(first: dict, text: str, mapping: dict) -> tuple[str, dict]:
    """Renumber the placeholders of a second text redacted on its own (both number from
    ``<PERSON_1>``): a value already in ``first`` takes its placeholder, a new value the next
    free number of its type. Returns ``(text renumbered, the joint mapping)``."""
    joint, by_value, renames = dict(first), {v: k for k, v in first.items()}, {}
    for ph, value in mapping.items():
        if value in by_value:
            renames[ph] = by_value[value]
            continue
        new, kind, n = ph, ph[1:-1].rsplit("_", 1)[0], 1
        while new in joint:
            new, n = f"<{kind}_{n}>", n + 1
        joint[new], by_value[value], renames[ph] = value, new, new
    return PLACEHOLDER.sub(lambda m: renames.get(m.group(0), m.group(0)), text), joint


def client_protection(cfg, client_entry=None) -> str:
    """The protection mode of one client.

    Args:
        cfg: the composed config (``cfg.privacy.enabled``, ``cfg.privacy.protection``).
        client_entry: the client's ``federation.clients`` entry (mapping) or None.

    Returns:
        ``off`` when ``privacy.enabled`` is false; else the entry's ``protection`` key if
        present, else ``cfg.privacy.protection``.

    Raises:
        ValueError: the resulting mode is not one of :data:`PROTECTIONS`.
    """
    priv = cfg.get("privacy", None) or {}
    if not priv.get("enabled", True):
        return "off"
    mode = None
    if client_entry is not None and hasattr(client_entry, "get"):
        mode = client_entry.get("protection", None)
    if mode is None:
        mode = priv.get("protection", "off")
    if mode is False:  # YAML 1.1 reads an unquoted `off` as false
        mode = "off"
    return check_mode(str(mode))
