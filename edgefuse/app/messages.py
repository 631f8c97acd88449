"""What the ServerApp and the ClientApp agree on about a message, and the one way the server
asks a single node.

Every message but ``query.info`` names the adapter group it is addressed to (the config's
``adapter_model`` / ``adapter_rank``: the destination node's base model and LoRA rank, as the
server knows them from ``query.info``). The server writes them in
:meth:`edgefuse.app.strategy.GroupedLoRA.content`; the ClientApp checks them with
:func:`check_group` before it loads anything, whatever the message kind (train, evaluate,
C2C queries, fuser downloads, decoding, privacy).

A phase asks one node with :func:`ask`: the message carries the config, the node's current
adapter and its group, plus the phase's records; a missing or error reply raises one
:class:`NodeError` that names the node, the message type and the client's error line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from flwr.app import Message, RecordDict

GROUP_MODEL = "adapter_model"
GROUP_RANK = "adapter_rank"

# The query kinds both apps use (Flower message type ``query.<kind>``), defined once.
INFO, FUSERS, SHARE, REFINE, ANSWER, FORGET, DECODE, PRIVACY = (
    "info", "fusers", "share", "refine", "answer", "forget", "decode", "privacy")
QUERY_KINDS = (INFO, FUSERS, SHARE, REFINE, ANSWER, FORGET, DECODE, PRIVACY)


FUSER_CONTROLS = ("zero", "shuffled")  # control fusers a receiver may hold beside a pair's real one


def fuser_key(sharer: str, control: str = "none") -> str:
    """The record name of one fuser in ``query.fusers`` and in a receiver's state:
    ``fuser.<sharer>`` for the pair's real fuser, ``fuser.<sharer>@<control>`` for its
    zero- or shuffled-sharer control (:attr:`edgefuse.c2c.fuser.FuserConfig.sharer_control`);
    its ``meta.`` entry takes the same suffix (:func:`fuser_meta_key`)."""
    return f"fuser.{sharer}" if control == "none" else f"fuser.{sharer}@{control}"


def fuser_meta_key(sharer: str, control: str = "none") -> str:
    """``meta.<sharer>`` / ``meta.<sharer>@<control>``: the card, config and shapes of :func:`fuser_key`."""
    return "meta" + fuser_key(sharer, control)[len("fuser"):]


def query_type(kind: str) -> str:
    """The Flower message type of a query kind: ``query_type(DECODE) == "query.decode"``.

    Raises:
        ValueError: ``kind`` is not one of :data:`QUERY_KINDS`.
    """
    if kind not in QUERY_KINDS:
        raise ValueError(f"unknown query kind {kind!r}: use one of {', '.join(QUERY_KINDS)}")
    return f"query.{kind}"


class NodeError(RuntimeError):
    """A node did not answer a message, answered with an error, or sent a reply that does
    not parse (the node, the message type and the reason are in the message)."""


class GroupMismatchError(ValueError):
    """A message addressed to another adapter group than this node's, or to none: refused
    before the node loads or applies anything."""


def last_line(text: str) -> str:
    """The last non-empty line of a (traceback) text: the exception and its message."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else str(text)


def group_fields(node) -> dict:
    """The group a message to ``node`` (a :class:`~edgefuse.app.strategy.NodeInfo`) is
    addressed to: ``{"adapter_model": model, "adapter_rank": LoRA rank}``."""
    return {GROUP_MODEL: str(node.model), GROUP_RANK: int(node.lora_rank)}


def check_group(config: Mapping, model: str, rank: int, message_type: str) -> None:
    """Refuse a message whose group fields are not this node's ``model`` / ``rank``.

    Args:
        config: the message's ``config`` record.
        model, rank: this node's base model and LoRA rank (its federation entry).
        message_type: for the error text.

    Raises:
        GroupMismatchError: a group field is missing or names another model or rank.
    """
    if GROUP_MODEL not in config or GROUP_RANK not in config:
        raise GroupMismatchError(f"{message_type} refused: the message names no adapter group "
                                 f"({GROUP_MODEL}, {GROUP_RANK})")
    got_model, got_rank = str(config[GROUP_MODEL]), int(config[GROUP_RANK])
    if (got_model, got_rank) != (str(model), int(rank)):
        raise GroupMismatchError(
            f"{message_type} refused: addressed to adapter group {got_model} rank {got_rank}, "
            f"this node is {model} rank {rank}")


@dataclass(frozen=True)
class Reply:
    """A node's (error-free) reply to :func:`ask`; ``reply[name]`` is its record ``name``."""

    node: Any
    message_type: str
    content: RecordDict

    def __getitem__(self, name: str):
        try:
            return self.content[name]
        except KeyError:
            raise NodeError(f"{_who(self.node)} {self.message_type}: the reply has no "
                            f"record {name!r}") from None

    def json(self, record: str, key: str) -> Any:
        """The JSON-encoded field ``key`` of the reply's ConfigRecord ``record``, decoded.

        Raises:
            NodeError: the record or field is missing, or is not JSON.
        """
        rec = self[record]
        if key not in rec:
            raise NodeError(f"{_who(self.node)} {self.message_type}: the reply has no "
                            f"{record}.{key}")
        try:
            return json.loads(str(rec[key]))
        except json.JSONDecodeError as e:
            raise NodeError(f"{_who(self.node)} {self.message_type}: {record}.{key} is not "
                            f"JSON ({e})") from None


def ask(grid, strategy, node, message_type: str, records: Mapping | None = None, *,
        timeout: float, round_idx: int) -> Reply:
    """Send one message to one node and return its reply.

    The message is :meth:`~edgefuse.app.strategy.GroupedLoRA.content` for ``node`` (the
    config, the node's current adapter and its group fields) plus ``records`` (name →
    Flower record).

    Args:
        grid: Flower's Grid (or a proxy with its ``send_and_receive``).
        strategy: the run's :class:`~edgefuse.app.strategy.GroupedLoRA`.
        node: the :class:`~edgefuse.app.strategy.NodeInfo` to ask.
        message_type: e.g. ``"query.privacy"``.
        timeout: seconds to wait for the reply.
        round_idx: the round written into the config.

    Raises:
        NodeError: no reply within ``timeout``, or an error reply (its last line quoted).
    """
    (reply,) = ask_many(grid, strategy, [node], message_type, records, timeout=timeout, round_idx=round_idx)
    if isinstance(reply, NodeError):
        raise reply
    return reply


def ask_many(grid, strategy, nodes, message_type: str, records: Mapping | None = None, *,
             timeout: float, round_idx: int) -> list[Reply | NodeError]:
    """:func:`ask` of several nodes at once (one ``send_and_receive``: Flower runs them
    side by side as far as its resources allow). Returns, per node in order, its
    :class:`Reply` or the :class:`NodeError` that stands for it (no reply within ``timeout``,
    an error reply, or a reply from a node that was not asked)."""
    msgs = []
    for node in nodes:
        content, _ = strategy.content(round_idx, strategy.client_state(node), node)
        for name, rec in (records or {}).items():
            content[name] = rec
        msgs.append(Message(content, dst_node_id=int(node.node_id), message_type=message_type))
    replies = list(grid.send_and_receive(msgs, timeout=timeout))
    by_id = {}
    for r in replies:
        by_id.setdefault(int(r.metadata.src_node_id), r)
    out: list[Reply | NodeError] = []
    for node in nodes:
        r = by_id.get(int(node.node_id))
        if r is None and len(nodes) == len(replies) == 1:
            r = replies[0]  # one asked, one answered (a grid that does not stamp the sender)
        if r is None:
            out.append(NodeError(f"{_who(node)} did not answer {message_type} within {timeout:.0f} s"))
        elif r.has_error():
            out.append(NodeError(f"{_who(node)} {message_type}: {last_line(r.error.reason)}"))
        else:
            out.append(Reply(node, message_type, r.content))
    return out


def _who(node) -> str:
    return f"partition {node.partition_id} ({node.model}, node {node.node_id})"
