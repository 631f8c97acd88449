"""``edgefuse cloud generate`` end to end on tiny random-weight models: the answers of every
mode against the target's and the edge's own greedy tokens, what reaches the cloud under
each protection and cache authorization, and the one-line errors with their exit codes.

The service is an in-process :class:`CloudService` over ``tiny-qwen2`` (the weights
``edgefuse cloud serve --model tiny-qwen2`` loads); the command runs as a subprocess
(``python -m edgefuse.cli``), or in process where the test inspects what the cloud received.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from edgefuse.cli.main import main
from edgefuse.cloud.chat import _prompt_ids, load_edge
from edgefuse.cloud.decoding import EdgeLM
from edgefuse.cloud.protocol import CloudAuth
from edgefuse.cloud.service import CloudService
from edgefuse.cloud.split_target import SplitTarget
from edgefuse.cloud.target import Target
from edgefuse.models import load_model
from tests.cli.test_cli_errors import cli, free_port
from tests.cloud.conftest import service_keys, target_greedy
from tests.cloud.test_cloud_auth import ref_greedy

PROMPT = "Tell me about the quick brown fox."
N = 8  # new tokens


class RecordingTarget(Target):
    """A :class:`Target` that keeps every OPEN it is sent (prompt ids and cache tuple)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.opens = []

    def open(self, msg):
        self.opens.append(msg)
        return super().open(msg)


@pytest.fixture(scope="module")
def target():
    return load_model("tiny-qwen2")


@pytest.fixture(scope="module")
def service(target):
    model, tok = target
    svc = CloudService(RecordingTarget(model, tok, "tiny-qwen2"), "127.0.0.1", 0, max_wait_ms=2,
                       split=SplitTarget(model, tok, "tiny-qwen2", max_context=512, max_batch_tokens=512),
                       **service_keys())
    svc.start_in_thread()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, target):
    """A PEFT adapter folder for tiny-qwen2 that changes its greedy tokens sometimes, not
    always: with it the edge drafts tokens the target partly rejects."""
    from edgefuse.lora import attach_lora

    model, _ = load_model("tiny-qwen2")
    peft = attach_lora(model, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"], seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    path = tmp_path_factory.mktemp("adapter")
    peft.save_pretrained(path)
    return str(path)


def greedy_text(model, tok, text: str, n: int = N) -> str:
    """What ``cloud generate`` prints for ``model``'s own greedy answer to ``text`` (one
    user turn, cut at the edge's end-of-turn ids)."""
    ids = _prompt_ids(tok, [{"role": "user", "content": text}])
    out = target_greedy(model, ids, n)
    eos = EdgeLM(model, tok).eos_ids
    out = out[:next((i for i, t in enumerate(out) if t in eos), len(out))]
    return tok.decode(out, skip_special_tokens=True)


def generate(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgefuse.cli", "cloud", "generate", "--model", "tiny-qwen2",
                           "--threads", "1", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("mode", ["split", "split_spec"])
def test_split_modes_answer_as_the_target(service, target, adapter, mode):
    """``--mode split|split_spec --target tiny-qwen2``: the device runs the target's first
    layer and its head, the cloud the rest (float16 rows), and prints the target's greedy
    answer; the figures name the round trips (split: one per token and one for the prompt's
    prefill)."""
    model, tok = target
    res = generate("--mode", mode, "--protection", "off", "--adapter", adapter, "--prompt", PROMPT,
                   "--max-new-tokens", str(N), "--gamma", "3", "--target", "tiny-qwen2", "--split-k", "1",
                   "--split-m", "0", "--split-act", "float16", "--port", str(service.port))
    assert res.returncode == 0, res.stderr
    assert res.stdout == greedy_text(model, tok, PROMPT) + "\n"
    figures = dict(re.findall(r"^\[(\w+)\] (.*)$", res.stderr, re.M))
    assert set(figures) == {mode}
    if mode == "split_spec":
        assert 0 < float(re.search(r"acceptance (\d\.\d\d)", figures[mode]).group(1)) < 1, figures


def test_split_mode_with_a_split_the_target_cannot_take_is_one_line(service):
    res = generate("--mode", "split", "--protection", "off", "--prompt", PROMPT, "--target", "tiny-qwen2",
                   "--split-k", "2", "--split-m", "2", "--port", str(service.port))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "k" in res.stderr, res.stderr


def test_every_mode_answers_as_its_reference(service, target, adapter):
    """``--mode all`` with a perturbed edge (``--adapter``): edge prints the edge's own greedy
    answer, fusion at w = 1 the same, cloud and both speculative modes the target's (which
    differs from the edge's); with γ fixed at 3 the sync figures show some drafts kept and some
    rejected (the async look-ahead follows the timing, so there only some kept)."""
    model, tok = target
    res = generate("--mode", "all", "--protection", "off", "--adapter", adapter, "--prompt", PROMPT,
                   "--max-new-tokens", str(N), "--gamma", "3", "--fusion-weight", "1.0",
                   "--port", str(service.port))
    assert res.returncode == 0, res.stderr
    edge_model, _ = load_edge("tiny-qwen2", adapter)
    want_edge, want_target = greedy_text(edge_model, tok, PROMPT), greedy_text(model, tok, PROMPT)
    assert want_edge != want_target
    want = "".join(f"{m}> {t}\n" for m, t in (("edge", want_edge), ("cloud", want_target),
                                                 ("spec_sync", want_target), ("spec_async", want_target),
                                                 ("fusion_static", want_edge)))
    assert res.stdout.startswith(want + "fusion_adaptive> "), res.stdout
    figures = dict(re.findall(r"^\[(\w+)\] (.*)$", res.stderr, re.M))
    assert set(figures) == {"edge", "cloud", "spec_sync", "spec_async", "fusion_static", "fusion_adaptive"}
    assert "1.00 round trips/token" in figures["cloud"] and "0.00 round trips/token" in figures["edge"]
    rate = {m: float(re.search(r"acceptance (\d\.\d\d)", figures[m]).group(1)) for m in ("spec_sync", "spec_async")}
    assert 0 < rate["spec_sync"] < 1 and rate["spec_async"] > 0, figures
    assert "edge weight 1.00" in figures["fusion_static"] and "note:" not in res.stderr


EMAIL, PHONE = "alice.smith@example.com", "212-555-0199"
PRIVATE = f"Write to {EMAIL} or call {PHONE} about the fox."


def _sent_text(service, tok) -> str:
    """The prompt of the last session the cloud opened, as text."""
    return tok.decode(service.target.opens[-1].prompt)


def _run(capsys, *args) -> tuple[int, str, str]:
    """``edgefuse cloud generate`` in this process; ``(exit status, stdout, stderr)``."""
    rc = main(["cloud", "generate", "--model", "tiny-qwen2", "--max-new-tokens", "4", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_protection_decides_what_reaches_the_cloud(service, target, capsys):
    """``--protection off`` sends the raw prompt; ``redact`` sends placeholders and the note on
    stderr shows exactly that text; the default (the main job's ``both``) sends no raw value."""
    _, tok = target
    port = ["--port", str(service.port), "--mode", "cloud", "--prompt", PRIVATE]
    rc, _, err = _run(capsys, *port, "--protection", "off")
    assert rc == 0 and EMAIL in _sent_text(service, tok) and PHONE in _sent_text(service, tok)
    assert "[protection" not in err
    rc, _, err = _run(capsys, *port, "--protection", "redact")
    note = re.search(r"^\[protection redact\] sent: (Write to <EMAIL_ADDRESS_1> or call <[A-Z_]+_1> about the fox\.)$",
                     err, re.M)
    assert rc == 0 and note, err
    sent = _sent_text(service, tok)
    assert note.group(1) in sent and EMAIL not in sent and PHONE not in sent
    rc, _, err = _run(capsys, *port)
    sent = _sent_text(service, tok)
    assert rc == 0 and "[protection both" in err and EMAIL not in sent and PHONE not in sent


def test_a_chat_numbers_placeholders_over_all_its_turns(service, target, capsys, monkeypatch):
    """Two chat turns naming two addresses: the second OPEN carries the whole protected chat,
    the first address as <EMAIL_ADDRESS_1> and the second as <EMAIL_ADDRESS_2>, neither raw."""
    import io

    _, tok = target
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"Write to {EMAIL}.\nNow write to bob@example.org.\n"))
    rc, out, err = _run(capsys, "--port", str(service.port), "--mode", "cloud", "--protection", "redact")
    assert rc == 0 and out.count("cloud> ") == 2
    sent = _sent_text(service, tok)
    assert "Write to <EMAIL_ADDRESS_1>." in sent and "Now write to <EMAIL_ADDRESS_2>." in sent
    assert EMAIL not in sent and "bob@example.org" not in sent


def test_cache_authorization_reaches_the_cloud(service, target, capsys):
    """``--no-flag-cache --l-cache 3``: the cloud is opened under (False, 3), and the cloud-mode
    answer is the target restricted to a 3-token window (computed here), not its full greedy."""
    model, tok = target
    rc, out, _ = _run(capsys, "--port", str(service.port), "--mode", "cloud", "--protection", "off",
                      "--no-flag-cache", "--l-cache", "3", "--prompt", PROMPT)
    assert rc == 0 and service.target.opens[-1].auth == CloudAuth(False, 3)
    ids = _prompt_ids(tok, [{"role": "user", "content": PROMPT}])
    windowed = ref_greedy(model, ids, 4, 3)
    eos = EdgeLM(model, tok).eos_ids
    windowed = windowed[:next((i for i, t in enumerate(windowed) if t in eos), len(windowed))]
    assert out == tok.decode(windowed, skip_special_tokens=True) + "\n"
    assert windowed != target_greedy(model, ids, len(windowed))
    rc, _, _ = _run(capsys, "--port", str(service.port), "--mode", "cloud", "--protection", "off",
                    "--prompt", PROMPT)
    assert rc == 0 and service.target.opens[-1].auth == CloudAuth(True, None)  # privacy.cloud_auth


@pytest.mark.parametrize("args, rc, line", [
    (["--mode", "telepathy"], 2, "edgefuse cloud generate: error: argument --mode: invalid choice: 'telepathy'"),
    (["--protection", "maybe"], 2, "edgefuse cloud generate: error: argument --protection: invalid choice: 'maybe'"),
    (["--model", "no-such-model"], 2, "edgefuse: error: unknown model 'no-such-model'"),
    (["--l-cache", "0"], 2, "edgefuse: error: --l-cache must be in 1..4294967294, got 0"),
    (["--host", "256.0.0.1"], 1, "edgefuse: error: no cloud service at 256.0.0.1:"),
])
def test_bad_arguments_are_one_line_errors(args, rc, line):
    got_rc, got = cli("cloud", "generate", "--model", "tiny-qwen2", "--mode", "cloud", "--prompt", "hi",
                      "--port", str(free_port()), *args)
    assert (got_rc, got[:len(line)]) == (rc, line), got


def test_a_dead_service_is_one_line_and_exit_1(target):
    model, tok = target
    svc = CloudService(Target(model, tok, "tiny-qwen2"), "127.0.0.1", 0, **service_keys())
    svc.start_in_thread()
    port = svc.port
    svc.stop()
    rc, line = cli("cloud", "generate", "--model", "tiny-qwen2", "--mode", "spec_sync", "--prompt", "hi",
                   "--port", str(port))
    assert rc == 1 and line.startswith(f"edgefuse: error: no cloud service at 127.0.0.1:{port}")
    assert "edgefuse cloud serve --model" in line
