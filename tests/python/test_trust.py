"""Issue 29, items 1 and 2, tried as a second uid would: a real memoffloadd
of another uid serving the runtime dir a trainer names, and fallback
checkpoints planted by another uid in the trainer's working directory.
The trainer (this process, root) refuses both: nothing is sent to the
foreign daemon, and no planted ``.metadata`` is unpickled."""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import time
from typing import Iterator, List

import pytest
import torch

import memoffload
import memoffload.torch as mot
from conftest import as_uid, bin_dir
from models import DecoderStack, tokens

ATTACKER = 61003

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")


def as_attacker(*argv: str) -> List[str]:
    return as_uid(ATTACKER, *argv)


@pytest.fixture
def squatter(shared_dir: str) -> Iterator[str]:
    """The attacker's own memoffloadd, serving <shared>/memoffload (which the
    attacker made first) and admitting root."""
    run = os.path.join(shared_dir, "memoffload")
    log = open(os.path.join(shared_dir, "attacker.log"), "wb")
    proc = subprocess.Popen(
        as_attacker(str(bin_dir() / "memoffloadd"), f"--runtime-dir={run}", "--socket-mode=0666",
                    "--allowed-uids=0", "--arena-size=16MiB", "--chunk-size=8MiB",
                    "--metrics-address=none", "--prefault-threads=1"),
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(os.path.join(run, "memoffload.sock")):
            assert proc.poll() is None and time.monotonic() < deadline, open(log.name).read()
            time.sleep(0.02)
        yield run
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def sessions_of(run: str) -> int:
    """Sessions the attacker's daemon holds (asked as the attacker)."""
    out = subprocess.run(as_attacker(str(bin_dir() / "memoffloadctl"), "--runtime-dir", run,
                                     "status", "--json"),
                         capture_output=True, text=True, check=True).stdout
    import json
    return int(json.loads(out).get("sessions", 0))


def test_offload_refuses_a_daemon_of_another_uid(squatter, monkeypatch):
    monkeypatch.setenv("MEMOFFLOAD_RUNTIME_DIR", squatter)
    model = DecoderStack(layers=3)
    try:
        with pytest.raises(memoffload.PermissionDenied) as raised:
            mot.offload_layers(model.layers, strict=True)
        assert raised.value.code == memoffload.StatusCode.PERMISSION_DENIED
        assert f"belongs to uid {ATTACKER}" in str(raised.value)
        assert str(raised.value).count("PERMISSION_DENIED") == 1, str(raised.value)  # said once
        # Without strict: no daemon, training goes on, the code says why.
        handle = mot.offload_layers(model.layers, min_tensor_bytes=0)
        model(tokens()).backward()
        stats = mot.get_offloader().stats()
        assert not stats["connected"]
        assert stats["last_skip_code"] == memoffload.StatusCode.PERMISSION_DENIED
        handle.remove()
        assert sessions_of(squatter) == 0
    finally:
        mot.forget_offloader()


def test_a_checkpoint_is_not_sent_to_a_daemon_of_another_uid(squatter, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from memoffload.torch.checkpoint import MemoffloadWriter

    writer = MemoffloadWriter(job_id="victim", runtime_dir=squatter, fallback_dir=str(tmp_path / "fb"))
    with pytest.raises(CheckpointException) as refused, pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(4)}, storage_writer=writer, checkpoint_id="s1", no_dist=True)
    assert isinstance(refused.value.failures[0][0], memoffload.PermissionDenied), refused.value
    assert sessions_of(squatter) == 0


class _Planted:
    """What the attacker's .metadata runs when it is unpickled."""

    def __init__(self, proof: str) -> None:
        self.proof = proof

    def __reduce__(self):
        return (open, (self.proof, "w"))


def plant_checkpoint(fallback_dir: str, ckpt_id: str, job: str, proof: str) -> None:
    """The attacker writes a complete-looking checkpoint dated in the future."""
    blob = pickle.dumps(_Planted(proof))
    script = (
        "import os, sys\n"
        "d = os.path.join(sys.argv[1], sys.argv[2])\n"
        "os.makedirs(d, exist_ok=True)\n"
        "open(os.path.join(d, '.memoffload-job'), 'w').write(sys.argv[3] + '\\n')\n"
        "open(os.path.join(d, '.metadata'), 'wb').write(bytes.fromhex(sys.argv[4]))\n"
        "t = 4102444800\n"  # 2100-01-01
        "os.utime(os.path.join(d, '.metadata'), (t, t))\n"
    )
    subprocess.run(as_attacker("/usr/bin/python3", "-c", script, fallback_dir, ckpt_id, job,
                               blob.hex()), check=True)


def test_planted_fallback_checkpoint_is_ignored_and_never_unpickled(shared_dir, monkeypatch, caplog):
    """The default fallback dir is ./memoffload-checkpoints/<job>: in a shared
    working dir the attacker makes it first and plants a checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from memoffload.torch.checkpoint import MemoffloadReader, latest_checkpoint

    monkeypatch.chdir(shared_dir)
    monkeypatch.setenv("MEMOFFLOAD_RUNTIME_DIR", os.path.join(shared_dir, "no-daemon"))
    monkeypatch.delenv("MEMOFFLOAD_CHECKPOINT_DIR", raising=False)
    proof = os.path.join(shared_dir, "unpickled")
    subprocess.run(as_attacker("mkdir", "-m", "0777", "-p", "memoffload-checkpoints/victim"),
                   check=True)
    plant_checkpoint(os.path.join(shared_dir, "memoffload-checkpoints", "victim"), "step-999",
                     "victim", proof)
    with caplog.at_level(logging.WARNING, logger="memoffload"):
        assert latest_checkpoint(job_id="victim") is None
        assert latest_checkpoint(job_id="victim") is None
    told = [r for r in caplog.records if "another user could have written" in r.getMessage()]
    assert len(told) == 1, [r.getMessage() for r in caplog.records]
    assert told[0].code == memoffload.StatusCode.PERMISSION_DENIED
    # Loading it by name (DCP's load folds the error into its own text).
    reader = MemoffloadReader(job_id="victim")
    reader.reset(checkpoint_id="step-999")
    with pytest.raises(memoffload.PermissionDenied) as refused:
        reader.read_metadata()
    assert refused.value.code == memoffload.StatusCode.PERMISSION_DENIED
    with pytest.raises(CheckpointException), pytest.warns(UserWarning):
        dcp.load({"w": torch.zeros(4)}, storage_reader=MemoffloadReader(job_id="victim"),
                 checkpoint_id="step-999", no_dist=True)
    assert not os.path.exists(proof), "the planted .metadata was unpickled"


def test_fallback_save_refuses_a_dir_of_another_uid_and_makes_its_own_0700(shared_dir, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from memoffload.torch.checkpoint import MemoffloadWriter, latest_checkpoint

    monkeypatch.chdir(shared_dir)
    monkeypatch.setenv("MEMOFFLOAD_RUNTIME_DIR", os.path.join(shared_dir, "no-daemon"))
    monkeypatch.delenv("MEMOFFLOAD_CHECKPOINT_DIR", raising=False)
    # A shared MEMOFFLOAD_CHECKPOINT_DIR made by someone else: the save is refused.
    theirs = os.path.join(shared_dir, "theirs")
    subprocess.run(as_attacker("mkdir", "-m", "0777", theirs), check=True)
    with pytest.raises(CheckpointException) as refused, pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(4)}, storage_writer=MemoffloadWriter(job_id="victim", fallback_dir=theirs),
                 checkpoint_id="s1", no_dist=True)
    assert isinstance(refused.value.failures[0][0], memoffload.PermissionDenied), refused.value
    assert os.listdir(theirs) == []
    # The default: ./memoffload-checkpoints/<job>, every dir made 0700.
    with pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(4)}, storage_writer=MemoffloadWriter(job_id="victim"),
                 checkpoint_id="s1", no_dist=True)
    for path in ("memoffload-checkpoints", "memoffload-checkpoints/victim"):
        assert os.stat(path).st_mode & 0o777 == 0o700, path
    assert latest_checkpoint(job_id="victim") == "s1"


FLIPPER = """
import os, sys, time
link, targets = sys.argv[1], sys.argv[2:]
for i in range(10 ** 9):
    tmp = link + ".tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(targets[i % len(targets)], tmp)
    os.rename(tmp, link)
    time.sleep(0.0005)
"""


def test_a_fallback_dir_reached_through_another_uids_dir_is_refused_and_a_flip_never_loads(
        shared_dir, tmp_path, monkeypatch, caplog):
    """Issue 38: the fallback dir was checked by where it resolved to, then
    DCP opened the path as given. ``<shared>/att/link/job``, where the
    attacker owns ``att`` and ``link`` leads to the victim's own checkpoints,
    passed; flipping ``link`` to the attacker's files between the check and
    DCP's open ran their pickle in 5 of 300 loads. Now the path is refused
    while it passes through the attacker's dir, whether the link leads to the
    victim's files or flips, and the planted pickle never runs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter, latest_checkpoint

    monkeypatch.setenv("MEMOFFLOAD_RUNTIME_DIR", os.path.join(shared_dir, "no-daemon"))
    real = str(tmp_path / "real")
    with pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(4)}, storage_writer=MemoffloadWriter(job_id="job", fallback_dir=f"{real}/job"),
                 checkpoint_id="step-1", no_dist=True)
    att = os.path.join(shared_dir, "att")
    subprocess.run(as_attacker("mkdir", "-m", "0755", att), check=True)
    proof = str(tmp_path / "unpickled")
    plant_checkpoint(os.path.join(att, "evil", "job"), "step-1", "job", proof)
    link = os.path.join(att, "link")
    subprocess.run(as_attacker("ln", "-s", real, link), check=True)
    through = os.path.join(link, "job")
    why = f"directory {att} on the way to {through} belongs to uid {ATTACKER}"

    def load() -> None:
        reader = MemoffloadReader(job_id="job", fallback_dir=through)
        reader.reset(checkpoint_id="step-1")
        reader.read_metadata()

    # The link leads to the victim's own, complete checkpoint: still refused.
    with pytest.raises(memoffload.PermissionDenied, match=why):
        load()
    with pytest.raises(CheckpointException) as refused, pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(4)}, storage_writer=MemoffloadWriter(job_id="job", fallback_dir=through),
                 checkpoint_id="step-2", no_dist=True)
    assert isinstance(refused.value.failures[0][0], memoffload.PermissionDenied), refused.value
    assert sorted(os.listdir(f"{real}/job")) == ["step-1"]
    with caplog.at_level(logging.WARNING, logger="memoffload"):
        assert latest_checkpoint(job_id="job", fallback_dir=through) is None
    assert any(why in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    # The attacker flips the link between the victim's dir and its own.
    flipper = subprocess.Popen(as_attacker("/usr/bin/python3", "-c", FLIPPER, link, real,
                                           os.path.join(att, "evil")))
    try:
        outcomes = {}
        for _ in range(300):
            try:
                load()
                outcome = "loaded"
            except memoffload.PermissionDenied:
                outcome = "refused"
            except (FileNotFoundError, NotADirectoryError):
                outcome = "not found"  # between the attacker's unlink and rename
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    finally:
        flipper.kill()
        flipper.wait()
    assert not os.path.exists(proof), f"the attacker's .metadata was unpickled ({outcomes})"
    assert set(outcomes) <= {"refused", "not found"} and outcomes.get("refused", 0) > 0, outcomes
    # The victim's own path still loads what it saved.
    state = {"w": torch.zeros(4)}
    with pytest.warns(UserWarning):
        dcp.load(state, storage_reader=MemoffloadReader(job_id="job", fallback_dir=f"{real}/job"),
                 checkpoint_id="step-1", no_dist=True)
    assert torch.equal(state["w"], torch.ones(4))


def test_a_symlink_only_the_user_or_root_can_change_is_followed(shared_dir, tmp_path, monkeypatch):
    """A fallback dir reached through the user's own symlink (scratch space
    linked from home, say) saves and loads; every file it reads and writes is
    opened below the verified dir's descriptor."""
    import torch.distributed.checkpoint as dcp
    from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter, latest_checkpoint

    monkeypatch.setenv("MEMOFFLOAD_RUNTIME_DIR", os.path.join(shared_dir, "no-daemon"))
    (tmp_path / "scratch").mkdir(mode=0o700)
    os.symlink(tmp_path / "scratch", tmp_path / "link")
    through = str(tmp_path / "link" / "job")
    for step in (1, 2, 3):
        with pytest.warns(UserWarning):
            dcp.save({"w": torch.full((4,), float(step))},
                     storage_writer=MemoffloadWriter(job_id="job", fallback_dir=through, keep_last=2),
                     checkpoint_id=f"step-{step}", no_dist=True)
    assert sorted(os.listdir(tmp_path / "scratch" / "job")) == ["step-2", "step-3"]
    assert latest_checkpoint(job_id="job", fallback_dir=through) == "step-3"
    state = {"w": torch.zeros(4)}
    with pytest.warns(UserWarning):
        dcp.load(state, storage_reader=MemoffloadReader(job_id="job", fallback_dir=through),
                 checkpoint_id="step-3", no_dist=True)
    assert torch.equal(state["w"], torch.full((4,), 3.0))
    # A symlink planted inside a checkpoint dir is refused, never followed.
    os.symlink("/etc/passwd", tmp_path / "scratch" / "job" / "step-3" / "extra")
    with pytest.raises(memoffload.PermissionDenied, match="is a symlink"):
        reader = MemoffloadReader(job_id="job", fallback_dir=through)
        reader.reset(checkpoint_id="step-3")
        reader.read_metadata()


def test_a_checkpoint_dir_that_is_a_link_or_a_fifo_for_metadata_is_refused_clearly(
        shared_dir, tmp_path, monkeypatch):
    """From the review: a checkpoint dir that is a symlink (the user's own)
    read as "not found" and a save into it raised a bare NotADirectoryError;
    a FIFO in place of .metadata made the load wait for ever in open()."""
    import threading

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from memoffload.torch.checkpoint import MemoffloadReader, MemoffloadWriter, latest_checkpoint

    monkeypatch.setenv("MEMOFFLOAD_RUNTIME_DIR", os.path.join(shared_dir, "no-daemon"))
    fallback = tmp_path / "fb"
    kw = dict(job_id="job", fallback_dir=str(fallback), keep_last=None)
    with pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(4)}, storage_writer=MemoffloadWriter(**kw), checkpoint_id="real",
                 no_dist=True)
    os.symlink(fallback / "real", fallback / "linked")

    def load(ckpt_id: str) -> None:
        reader = MemoffloadReader(job_id="job", fallback_dir=str(fallback))
        reader.reset(checkpoint_id=ckpt_id)
        reader.read_metadata()

    with pytest.raises(memoffload.PermissionDenied, match="checkpoint dir .*linked is a symlink"):
        load("linked")
    with pytest.raises(CheckpointException) as refused, pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(4)}, storage_writer=MemoffloadWriter(**kw), checkpoint_id="linked",
                 no_dist=True)
    assert isinstance(refused.value.failures[0][0], memoffload.PermissionDenied), refused.value
    # A FIFO where .metadata should be: refused at once, never opened for a wait.
    (fallback / "fifo").mkdir(mode=0o700)
    shutil.copy(fallback / "real" / ".memoffload-job", fallback / "fifo" / ".memoffload-job")
    os.mkfifo(fallback / "fifo" / ".metadata", 0o600)
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(_raised(load, "fifo")), daemon=True)
    worker.start()
    worker.join(10)
    assert outcome, "the load waited on a FIFO"
    assert isinstance(outcome[0], memoffload.PermissionDenied), outcome
    assert "is not a regular file" in str(outcome[0]), outcome
    assert latest_checkpoint(job_id="job", fallback_dir=str(fallback)) == "real"


def _raised(fn, *args):
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        return exc
    return None


def test_runtime_dir_of_follows_the_discovery_order(monkeypatch):
    from memoffload.torch.checkpoint import store

    if os.path.exists("/run/memoffload/broker.sock"):
        pytest.skip("a system daemon here takes discovery first")
    monkeypatch.setenv("MEMOFFLOAD_RUNTIME_DIR", "/from/env")
    assert store.runtime_dir_of("/from/arg") == "/from/arg"
    assert store.runtime_dir_of("") == "/from/env"
    monkeypatch.delenv("MEMOFFLOAD_RUNTIME_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/7")
    assert store.runtime_dir_of("") == "/run/user/7/memoffload"  # for root too
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert store.runtime_dir_of("") == f"/tmp/memoffload-{os.geteuid()}"


def test_libmemoffload_discovers_the_dir_runtime_dir_of_names(monkeypatch, tmp_path):
    """The same order in C++ and Python: with no daemon anywhere, the
    native client's error names the socket of the dir Python names."""
    from memoffload.torch.checkpoint import store

    if os.path.exists("/run/memoffload/broker.sock"):
        pytest.skip("a system daemon here takes discovery first")
    cases = [{"MEMOFFLOAD_RUNTIME_DIR": str(tmp_path / "env")},
             {"MEMOFFLOAD_RUNTIME_DIR": "", "XDG_RUNTIME_DIR": str(tmp_path / "xdg")}]
    if not os.path.lexists(f"/tmp/memoffload-{os.geteuid()}"):
        cases.append({"MEMOFFLOAD_RUNTIME_DIR": "", "XDG_RUNTIME_DIR": ""})
    for env in cases:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        expected = store.runtime_dir_of("")
        with pytest.raises(memoffload.Unavailable) as raised:
            mot.daemon_status(timeout_ms=500)
        assert f"unix:{expected}/memoffload.sock" in str(raised.value), (env, str(raised.value))
