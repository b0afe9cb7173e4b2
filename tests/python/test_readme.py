"""The README's PyTorch snippet ("Using it from a PyTorch trainer") runs
verbatim: the exact text of its first python block, against a real daemon
named by MEMOFFLOAD_RUNTIME_DIR (as a user's environment would)."""

from __future__ import annotations

import io
import re
from contextlib import redirect_stdout

import torch

import memoffload.torch as mot
from conftest import REPO, assert_arena_empty

SECTION = "## Using it from a PyTorch trainer"


def readme_snippet() -> str:
    text = (REPO / "README.md").read_text()
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    section = text[text.index(SECTION) :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python block under {SECTION!r}"
    return match.group(1)


def test_readme_pytorch_snippet_runs_verbatim(daemon, monkeypatch):
    code = readme_snippet()
    monkeypatch.setenv("MEMOFFLOAD_RUNTIME_DIR", daemon.runtime_dir)
    mot.forget_offloader()  # the default runtime dir now means this daemon
    namespace = {"__name__": "__readme__"}
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), namespace)
        handle = namespace["handle"]
        s = handle.stats()
        # It really went through the daemon: groups offloaded and brought back.
        assert s["offloaded_bytes"] > 0, s
        assert s["prefetched_bytes"] > 0, s
        assert s["skipped_bytes"] == 0, s
        assert "offloaded_bytes" in out.getvalue()
        off = mot.get_offloader()
        del namespace
        assert_arena_empty(daemon, off)
    finally:
        mot.forget_offloader()


CHECKPOINT_SECTION = "## Checkpoints into the node"


def test_readme_checkpoint_snippet_runs_verbatim(daemon, monkeypatch, tmp_path):
    text = (REPO / "README.md").read_text()
    assert CHECKPOINT_SECTION in text, f"README.md has no section {CHECKPOINT_SECTION!r}"
    section = text[text.index(CHECKPOINT_SECTION) :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.setenv("MEMOFFLOAD_RUNTIME_DIR", daemon.runtime_dir)
    monkeypatch.chdir(tmp_path)  # where the durable files go
    namespace = {"__name__": "__readme__"}
    out = io.StringIO()
    with redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["start"] == 0
    assert out.getvalue().strip() == "step-3 ['step-2']", out.getvalue()
    assert sorted(p.name for p in (tmp_path / "ckpt" / "readme-demo").iterdir()
                  if not p.name.startswith(".")) == ["step-2"]
    # A restart of the job: the newest checkpoint, from the daemon.
    trained = namespace["model"].weight.detach().clone()
    namespace = {"__name__": "__readme__"}
    with redirect_stdout(io.StringIO()):
        exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["start"] == 3
    assert namespace["manager"].last_restore["tier"] == "daemon"
    assert torch.equal(namespace["model"].weight, trained)
    from memoffload import _C

    store = _C.RegionStore(job_id="readme-demo")
    try:
        names = sorted(r["name"] for r in store.list("dcp/"))
        assert any(n.startswith("dcp/step-3/") for n in names), names
        assert not any(n.startswith("dcp/step-1/") for n in names), names
        for n in names:
            store.delete(n)
    finally:
        store.close()
