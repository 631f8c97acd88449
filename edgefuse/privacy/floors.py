"""Device privacy floors: the least protection a device accepts, whatever the server's config says.

Every message carries the server's resolved config, and the device runs what it says
(``privacy.protection``, ``privacy.debug_text``, ``privacy.cloud_auth``, a client entry's own
``protection:``). A :class:`PrivacyFloor` is the device's own answer to "how much less than
that will I do": the server may **tighten** (a stricter config is simply used), never
**loosen** — :func:`check` refuses a config below the floor with a :class:`FloorViolation`
that names the key, the server's value, the floor and where the floor came from.

The floor lives on the device: ``floors.yaml`` in its home folder (``edgefuse.app.device``),
then node_config keys (:data:`NODE_KEYS`, e.g. ``floor-protection=redact``), each of which
overrides the file's field. Nothing the server sends chooses either. File format (every key
optional; unknown keys are refused)::

    protection: redact      # off | redact | rephrase | both: the least for prompts toward the cloud
    debug_text: false       # may raw private text appear in results?
    cloud: true             # does this device talk to a cloud at all?
    cloud_cache:            # the most the cloud may keep (privacy.cloud_auth)
      flag_cache: true      #   may it keep anything between requests?
      l_cache: null         #   the largest window in tokens (null = no limit)
    c2c_share: true         # does it share KV caches / answers with peers?
    redact:                 # what a redacting protection must do (floor redact / both)
      entities: [PERSON, EMAIL_ADDRESS, ...]  # must all be covered (default: the shipped list)
      score_threshold: 0.4  #   the highest Presidio threshold accepted
      known_identities: true  # the device's own identities redacted too

Defaults (no file, no keys): :data:`DEFAULT` — ``protection: redact`` (a device that never
configured anything still refuses plain text to the cloud), redaction at least as the
redactor's defaults (:data:`edgefuse.privacy.redact.DEFAULT_ENTITIES`, threshold 0.4, the
device's own identities on: what ``conf/privacy/default.yaml`` ships), ``debug_text: false``,
cloud, cache and C2C sharing allowed (the main job's defaults pass).

Protection order (a partial order): ``off < redact < both`` and ``off < rephrase < both``;
``redact`` and ``rephrase`` are not comparable, so a floor of ``redact`` accepts ``redact``
or ``both`` (:func:`protection_at_least`).
"""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass, field, fields as dc_fields, replace
from pathlib import Path
from typing import Any, Collection, Mapping

from edgefuse.privacy.protect import PROTECTIONS, check_mode, client_protection
from edgefuse.privacy.redact import DEFAULT_ENTITIES, DEFAULT_SCORE_THRESHOLD

FLOOR_FILE = "floors.yaml"
MAX_FLOOR_BYTES = 64 * 1024
FIELDS = ("protection", "debug_text", "cloud_cache", "cloud", "c2c_share")
"""The floor's fields, as :func:`check` names them."""
NODE_KEYS = {"floor-protection": "protection", "floor-debug-text": "debug_text",
             "floor-cloud": "cloud", "floor-flag-cache": "flag_cache",
             "floor-l-cache": "l_cache", "floor-c2c-share": "c2c_share",
             "floor-redact-entities": "redact_entities",
             "floor-redact-threshold": "redact_max_threshold",
             "floor-known-identities": "redact_known_identities"}
"""node_config key -> floor attribute (``floor-l-cache`` takes an int or ``none``,
``floor-redact-entities`` a comma-separated list)."""
_SECTIONS = {"cloud_cache": {"flag_cache": "flag_cache", "l_cache": "l_cache"},
             "redact": {"entities": "redact_entities", "score_threshold": "redact_max_threshold",
                        "known_identities": "redact_known_identities"}}
_TOP = {"protection", "debug_text", "cloud", "c2c_share"}


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 60, 60


def _short(value: Any) -> str:
    """A bounded repr for error messages: a YAML alias bomb or a huge server value stays short."""
    return _REPR.repr(value)


class FloorError(ValueError):
    """A floor that cannot be read: a malformed ``floors.yaml`` or node_config floor key
    (the message names the file or key and what is wrong)."""


class FloorViolation(ValueError):
    """The server's config is looser than this device's floor; nothing was run or sent."""


def protection_at_least(mode: str, floor: str) -> bool:
    """Whether protection ``mode`` is at least ``floor`` in the order
    ``off < redact < both``, ``off < rephrase < both`` (redact and rephrase not comparable).

    Raises:
        ValueError: either is not one of :data:`edgefuse.privacy.protect.PROTECTIONS`.
    """
    mode, floor = check_mode(mode), check_mode(floor)
    return floor == "off" or mode == floor or mode == "both"


@dataclass(frozen=True)
class PrivacyFloor:
    """The least protection a device accepts.

    Attributes:
        protection: least protection of prompts toward the cloud (:func:`protection_at_least`).
        debug_text: whether raw private text may appear in results (``privacy.debug_text``).
        flag_cache: whether the cloud may keep anything between requests.
        l_cache: the largest ``privacy.cloud_auth.l_cache`` (tokens), None = no limit.
        cloud: whether this device talks to a cloud at all.
        c2c_share: whether it shares KV caches / answers with peers.
        redact_entities: the entity types a redacting protection must cover (the server's
            ``privacy.redact.entities`` may add to them, not leave one out).
        redact_max_threshold: the highest ``privacy.redact.score_threshold`` accepted (a
            higher threshold redacts less).
        redact_known_identities: whether the device's own identities must be redacted too
            (``privacy.redact.known_identities``). The three apply when the floor's protection
            includes redaction (``redact`` / ``both``).
        sources: attribute -> where its value came from (a file path, a node_config key, or
            ``default (no <path>)``), quoted by :class:`FloorViolation` messages.
    """

    protection: str = "redact"
    debug_text: bool = False
    flag_cache: bool = True
    l_cache: int | None = None
    cloud: bool = True
    c2c_share: bool = True
    redact_entities: tuple[str, ...] = DEFAULT_ENTITIES
    redact_max_threshold: float = DEFAULT_SCORE_THRESHOLD
    redact_known_identities: bool = True
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def source(self, attr: str) -> str:
        """Where attribute ``attr`` came from (``default`` if not recorded)."""
        return self.sources.get(attr, "default")

    def to_dict(self) -> dict:
        """The floor in the file's format (no sources)."""
        return {"protection": self.protection, "debug_text": self.debug_text, "cloud": self.cloud,
                "cloud_cache": {"flag_cache": self.flag_cache, "l_cache": self.l_cache},
                "c2c_share": self.c2c_share,
                "redact": {"entities": list(self.redact_entities),
                           "score_threshold": self.redact_max_threshold,
                           "known_identities": self.redact_known_identities}}


DEFAULT = PrivacyFloor()
_ATTRS = tuple(f.name for f in dc_fields(PrivacyFloor) if f.name != "sources")


def _bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise FloorError(f"{where}: expected true or false, got {_short(value)}")


def _protection(value: Any, where: str) -> str:
    if value is False:  # YAML 1.1 reads an unquoted `off` as false
        return "off"
    if not isinstance(value, str) or value not in PROTECTIONS:
        raise FloorError(f"{where}: expected one of {', '.join(PROTECTIONS)}, got {_short(value)}")
    return value


def _l_cache(value: Any, where: str) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32 - 1:
        raise FloorError(f"{where}: expected null or an integer in 0..{2**32 - 2}, got {_short(value)}")
    return value


_ENTITY = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")


def _entities(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > 256 or \
            not all(isinstance(v, str) and _ENTITY.match(v) for v in value):
        raise FloorError(f"{where}: expected a list of entity type names (PERSON, EMAIL_ADDRESS ...), "
                         f"got {_short(value)}")
    return tuple(dict.fromkeys(value))


def _threshold(value: Any, where: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise FloorError(f"{where}: expected a number in [0, 1], got {_short(value)}")
    return float(value)


_PARSE = {"protection": _protection, "debug_text": _bool, "flag_cache": _bool, "l_cache": _l_cache,
          "cloud": _bool, "c2c_share": _bool, "redact_entities": _entities,
          "redact_max_threshold": _threshold, "redact_known_identities": _bool}


def parse(data: Any, where: str) -> dict:
    """Floor attributes from a parsed ``floors.yaml`` (a mapping, or None for an empty file).

    Returns:
        ``{attribute: value}`` for the keys present (the ``cloud_cache`` and ``redact``
        sections flattened into their attributes: ``flag_cache``, ``redact_entities`` ...).

    Raises:
        FloorError: not a mapping, an unknown key, or a value of the wrong type; the message
            starts with ``where`` and names the key.
    """
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise FloorError(f"{where}: expected a mapping of floor keys, got {type(data).__name__}")
    known = _TOP | set(_SECTIONS)
    unknown = sorted(_short(k) for k in data if k not in known)
    if unknown:
        raise FloorError(f"{where}: unknown keys {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    out = {}
    for key, value in data.items():
        if key in _SECTIONS:
            names = _SECTIONS[key]
            if not isinstance(value, Mapping):
                raise FloorError(f"{where}: {key}: expected a mapping with {' / '.join(names)}, "
                                 f"got {_short(value)}")
            bad = sorted(_short(k) for k in value if k not in names)
            if bad:
                raise FloorError(f"{where}: {key}: unknown keys {', '.join(bad)}; known: {', '.join(names)}")
            for k, v in value.items():
                out[names[k]] = _PARSE[names[k]](v, f"{where}: {key}.{k}")
        else:
            out[key] = _PARSE[key](value, f"{where}: {key}")
    return out


def load(path: str | Path | None = None, node_config: Mapping | None = None) -> PrivacyFloor:
    """The floor of a device: :data:`DEFAULT`, then ``path`` (a ``floors.yaml``) if it exists,
    then the node_config keys of :data:`NODE_KEYS`, each overriding the field it names.

    Args:
        path: the device's ``floors.yaml`` (absent file = defaults); None = no file.
        node_config: the node's own config (``flower-supernode --node-config``), or None.

    Returns:
        A :class:`PrivacyFloor` whose ``sources`` say where each field came from.

    Raises:
        FloorError: the file is not a regular file, is larger than :data:`MAX_FLOOR_BYTES`,
            is not UTF-8 YAML, or holds a bad key or value; or a node_config floor key is bad.
    """
    import yaml

    values: dict = {}
    sources = {a: "default" if path is None else f"default (no {path})" for a in _ATTRS}
    if path is not None:
        p = Path(path)
        if p.exists():
            if not p.is_file():
                raise FloorError(f"{p}: not a regular file")
            with p.open("rb") as f:
                raw = f.read(MAX_FLOOR_BYTES + 1)  # bounded, whatever the size said a moment ago
            if len(raw) > MAX_FLOOR_BYTES:
                raise FloorError(f"{p}: more than the {MAX_FLOOR_BYTES} bytes a floor file may hold")
            try:
                data = yaml.safe_load(raw.decode("utf-8"))
            except (UnicodeDecodeError, yaml.YAMLError) as e:
                raise FloorError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
            got = parse(data, str(p))
            values.update(got)
            sources.update({a: str(p) for a in got})
    for key, attr in NODE_KEYS.items():
        if node_config is not None and key in node_config:
            where, value = f"node_config {key}", node_config[key]
            if attr == "redact_entities" and isinstance(value, str):  # "PERSON,EMAIL_ADDRESS"
                value = [v.strip() for v in value.split(",") if v.strip()]
            values[attr] = _PARSE[attr](value, where)
            sources[attr] = where
    return replace(DEFAULT, **values, sources=sources)


def _cfg_get(cfg, *keys, default=None):
    """``cfg.k1.k2...`` through mappings with ``.get``; ``default`` where a level is missing."""
    node = cfg
    for k in keys:
        if node is None or not hasattr(node, "get"):
            return default
        node = node.get(k, None)
    return default if node is None else node


def _server_protection(cfg, entry, entry_key: str) -> tuple[str, str]:
    """(the server's protection for this client, the config setting that decides it)."""
    if not _cfg_get(cfg, "privacy", "enabled", default=True):
        return "off", "privacy.enabled=false (protection 'off')"
    if entry is not None and hasattr(entry, "get") and entry.get("protection", None) is not None:
        key = f"{entry_key}.protection"
    else:
        key = "privacy.protection"
    try:
        mode = client_protection(cfg, entry)
    except ValueError:
        raw = entry.get("protection") if key != "privacy.protection" else _cfg_get(cfg, "privacy", "protection")
        raise FloorViolation(f"protection: the server's {key}={_short(raw)} is not one of "
                             f"{', '.join(PROTECTIONS)}") from None
    return mode, f"{key}={mode!r}"


def _redact_violations(cfg, floor: PrivacyFloor) -> list[str]:
    """How the server's ``privacy.redact`` settings redact less than ``floor`` requires, read
    as the device's redactor reads them (:meth:`edgefuse.privacy.redact.Redactor.from_config`:
    empty entities = the defaults; the decoding handler: known_identities default false)."""
    red = _cfg_get(cfg, "privacy", "redact", default={})
    out = []
    ents = red.get("entities", None) if hasattr(red, "get") else None
    ents = list(ents) if ents else list(DEFAULT_ENTITIES)
    missing = [e for e in floor.redact_entities if e not in ents]
    if missing:
        out.append(f"protection: the server's privacy.redact.entities leaves out {', '.join(missing)}, which "
                   f"this device's floor redact.entities requires (from {floor.source('redact_entities')})")
    thr = red.get("score_threshold", DEFAULT_SCORE_THRESHOLD) if hasattr(red, "get") else DEFAULT_SCORE_THRESHOLD
    if isinstance(thr, bool) or not isinstance(thr, (int, float)):
        out.append(f"protection: the server's privacy.redact.score_threshold={_short(thr)} is not a number")
    elif not thr <= floor.redact_max_threshold:  # NaN compares false both ways: refused too
        out.append(f"protection: the server's privacy.redact.score_threshold={thr} is looser than this "
                   f"device's floor redact.score_threshold={floor.redact_max_threshold} "
                   f"(from {floor.source('redact_max_threshold')})")
    known = red.get("known_identities", False) if hasattr(red, "get") else False
    if floor.redact_known_identities and not bool(known):
        out.append(f"protection: the server's privacy.redact.known_identities={str(bool(known)).lower()} is "
                   f"looser than this device's floor redact.known_identities=true "
                   f"(from {floor.source('redact_known_identities')})")
    return out


def violations(cfg, entry, floor: PrivacyFloor, fields: Collection[str] = FIELDS,
               requests: Collection[str] = (), entry_key: str = "federation.clients[this device]") -> list[str]:
    """The ways ``cfg`` is looser than ``floor`` in ``fields`` (one line each; empty = none).

    ``requests`` names the capabilities (``cloud``, ``c2c_share``) the message itself would
    use, whatever the config says (a decoding request contacts the cloud even if
    ``cloud.enabled`` is false); without it the config's ``cloud.enabled`` / ``c2c.enabled``
    count as the server's value.

    Raises:
        ValueError: a field not in :data:`FIELDS`.
    """
    bad = sorted(set(fields) - set(FIELDS)) + sorted(set(requests) - {"cloud", "c2c_share"})
    if bad:
        raise ValueError(f"unknown floor fields {bad}; known: {', '.join(FIELDS)}")
    out = []

    def show(v) -> str:
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else _short(v)

    def refuse(name: str, server: str, attr: str) -> None:
        out.append(f"{name}: the server's {server} is looser than this device's floor "
                   f"{attr}={show(getattr(floor, attr))} (from {floor.source(attr)})")

    if "protection" in fields:
        mode, said = _server_protection(cfg, entry, entry_key)
        if not protection_at_least(mode, floor.protection):
            refuse("protection", said, "protection")
        elif floor.protection in ("redact", "both"):  # the redaction it relies on, as configured
            out.extend(_redact_violations(cfg, floor))
    if "debug_text" in fields:
        value = _cfg_get(cfg, "privacy", "debug_text", default=False)
        if bool(value) and not floor.debug_text:  # any truthy value is raw text in results
            refuse("debug_text", f"privacy.debug_text={show(value)}", "debug_text")
    if "cloud_cache" in fields:
        flag = _cfg_get(cfg, "privacy", "cloud_auth", "flag_cache", default=True)
        lc = _cfg_get(cfg, "privacy", "cloud_auth", "l_cache", default=None)
        if not isinstance(flag, bool):
            out.append(f"cloud_cache: the server's privacy.cloud_auth.flag_cache={_short(flag)} is not a bool")
        elif flag and not floor.flag_cache:
            refuse("cloud_cache", "privacy.cloud_auth.flag_cache=true", "flag_cache")
        if lc is not None and (isinstance(lc, bool) or not isinstance(lc, int) or lc < 0):
            out.append(f"cloud_cache: the server's privacy.cloud_auth.l_cache={_short(lc)} is not null or "
                       "an integer >= 0")
        elif floor.l_cache is not None and (lc is None or lc > floor.l_cache):
            refuse("cloud_cache", f"privacy.cloud_auth.l_cache={show(lc)}", "l_cache")
    for name, section in (("cloud", "cloud"), ("c2c_share", "c2c")):
        if name not in fields or getattr(floor, name):
            continue
        if name in requests:
            what = "contacts the cloud" if name == "cloud" else "shares with a peer"
            out.append(f"{name}: the server's message {what}, looser than this device's floor "
                       f"{name}=false (from {floor.source(name)})")
        elif _cfg_get(cfg, section, "enabled", default=False):
            refuse(name, f"{section}.enabled=true", name)
    return out


def check(cfg, entry, floor: PrivacyFloor, fields: Collection[str] = FIELDS,
          requests: Collection[str] = (), entry_key: str = "federation.clients[this device]") -> None:
    """Refuse a server config looser than ``floor`` (see :func:`violations` for ``fields``
    and ``requests``); a stricter one passes and is used as it is.

    Args:
        cfg: the server's resolved config (``privacy.*``, ``cloud.enabled``, ``c2c.enabled``).
        entry: this device's ``federation.clients`` entry (its own ``protection:`` counts).
        floor: this device's :class:`PrivacyFloor`.

    Raises:
        FloorViolation: one line per violation, each naming the floor field, the config key,
            the server's value, the floor's value and the file (or node_config key) it came from.
    """
    found = violations(cfg, entry, floor, fields, requests, entry_key)
    if found:
        raise FloorViolation("the server's config is below this device's privacy floor: " + "; ".join(found))
