"""The Tinker server's bounds (:mod:`purerl.tinker`): what it writes and deletes, which paths a
request may reach, what one request may cost, and the one-line refusals of its command line.

Requests go through Starlette's ``TestClient`` from a loopback address (no process, no socket);
the command line's ``main`` runs in-process with the model loading replaced by a sentinel, so a
flag that is not refused before the model loads fails the test instead of serving.
"""

import os
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("tinker")

from starlette.testclient import TestClient  # noqa: E402

from purerl.io.checkpoint import save_checkpoint  # noqa: E402
from purerl.tinker import __main__ as cli  # noqa: E402
from purerl.tinker.launch import service_of, write_tiny_model  # noqa: E402
from purerl.tinker.server import app_of  # noqa: E402

KEY = "tml-" + "k" * 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tinker_limits") / "tiny")


def _client(service):
    """A client of a new app over ``service``, calling from 127.0.0.1 with the key."""
    client = TestClient(app_of(service, KEY), client=("127.0.0.1", 50000), headers={"X-API-Key": KEY})
    client.service = service
    return client


def _closed(client):
    for futures in client.app.state.queue:
        futures.close()


@pytest.fixture(scope="module")
def http(tiny, tmp_path_factory):
    store = tmp_path_factory.mktemp("tinker_limits_store") / "store"
    with _client(service_of(tiny, store=store)) as client:
        yield client
        _closed(client)


def _result(client, answer):
    """The result of the future a call answered (polling until it is done)."""
    assert answer.status_code == 200, answer.text
    while True:
        done = client.post("/api/v1/retrieve_future", json={"request_id": answer.json()["request_id"]})
        if done.headers["content-type"] == "application/x-protobuf":  # samples
            return {"protobuf": done.content}
        if done.json().get("type") != "try_again":
            return done.json()


def _model(client, rank=4):
    session = client.post("/api/v1/create_session", json={}).json()["session_id"]
    answer = client.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0,
                                                       "base_model": client.service.name,
                                                       "lora_config": {"rank": rank}})
    return session, answer


def _one_line(text: str) -> bool:
    return text.strip() != "" and "\n" not in text.strip() and "Traceback" not in text


# --tiny writes only into a new or empty folder, or over its own


def test_tiny_model_refuses_a_folder_it_did_not_write_and_leaves_its_files(tmp_path, monkeypatch):
    mine = tmp_path / "my-model"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes(b"my weights")
    (mine / "README").write_text("mine")
    with pytest.raises(ValueError, match="my-model: neither empty nor a tiny model") as refused:
        write_tiny_model(mine)
    assert _one_line(str(refused.value))
    assert sorted(p.name for p in mine.iterdir()) == ["README", "model.safetensors"]
    assert (mine / "model.safetensors").read_bytes() == b"my weights"
    monkeypatch.chdir(mine)  # --model . in a folder of the user's: nothing deleted
    with pytest.raises(ValueError, match="neither empty nor a tiny model"):
        write_tiny_model(".")
    assert sorted(p.name for p in mine.iterdir()) == ["README", "model.safetensors"]
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(ValueError, match="a file"):
        write_tiny_model(tmp_path / "a-file")
    assert (tmp_path / "a-file").read_text() == "mine"


def test_tiny_flag_refuses_a_users_folder_in_one_line_before_loading(tmp_path, monkeypatch, capsys):
    mine = tmp_path / "my-model"
    mine.mkdir()
    (mine / "README").write_text("mine")
    monkeypatch.setattr(cli, "service_of", _never)
    assert cli.main(["--model", str(mine), "--tiny"]) == 2
    err = capsys.readouterr().err
    assert _one_line(err) and str(mine) in err and ".purerl-tiny" in err
    assert [p.name for p in mine.iterdir()] == ["README"]


@pytest.mark.slow
def test_tiny_model_writes_a_new_or_empty_folder_and_again_over_its_own(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    for folder in (tmp_path / "new" / "nested", Path("."), Path(".")):  # the third: over the tiny model written there
        assert write_tiny_model(folder) == folder
        assert (folder / ".purerl-tiny").is_file() and (folder / "model.safetensors").is_file()
        assert not [p for p in folder.iterdir() if p.name.startswith(".tmp")]
    assert os.path.samefile(os.getcwd(), empty)  # the empty working folder was written into, not replaced


# every path a request names stays under --store


def _planted(root):
    """A checkpoint planted outside the store (``root``) at ``<root>/../weights/planted``."""
    planted = root.parent / "weights" / "planted"
    save_checkpoint(planted, {"x": torch.zeros(2)}, step=1, metadata={"base_model": "x", "lora": None})
    return planted


def test_a_model_id_of_dotdot_reaches_nothing_outside_the_store(http):
    store = http.service.store.root
    planted = _planted(store)
    info = http.post("/api/v1/weights_info", json={"tinker_path": "tinker://../weights/planted"})
    assert info.status_code == 400 and "tinker_path" in info.json()["error"], info.text
    gone = http.delete("/api/v1/training_runs/%2E%2E/checkpoints/weights/planted")
    assert gone.status_code == 400 and "training run id" in gone.json()["error"], gone.text
    assert http.get("/api/v1/training_runs/%2E%2E").status_code == 400
    assert http.get("/api/v1/training_runs/%2E%2E/checkpoints").status_code == 400
    assert planted.is_dir() and any(planted.iterdir())


def test_a_symlink_in_the_store_does_not_lead_outside_it(http):
    store = http.service.store.root
    planted = _planted(store)
    store.mkdir(parents=True, exist_ok=True)
    (store / "escape").symlink_to(planted.parent.parent, target_is_directory=True)
    info = http.post("/api/v1/weights_info", json={"tinker_path": "tinker://escape/weights/planted"})
    assert info.status_code == 400 and "outside the checkpoint store" in info.json()["error"], info.text
    assert http.delete("/api/v1/training_runs/escape/checkpoints/weights/planted").status_code == 400
    assert planted.is_dir()


def test_a_300_character_checkpoint_name_is_a_400_naming_the_limit_and_the_models_next_call_runs(http):
    long = "a" * 300
    info = http.post("/api/v1/weights_info", json={"tinker_path": f"tinker://m/weights/{long}"})
    assert info.status_code == 400 and "at most 128" in info.json()["error"], info.text
    _, answer = _model(http)
    model_id = _result(http, answer)["model_id"]
    saved = http.post("/api/v1/save_weights", json={"model_id": model_id, "path": long, "seq_id": 1})
    assert saved.status_code == 400 and "path" in saved.json()["error"] and "at most 128" in saved.json()["error"]
    after = http.post("/api/v1/save_weights", json={"model_id": model_id, "path": "short", "seq_id": 2})
    assert _result(http, after)["path"] == f"tinker://{model_id}/weights/short"  # the refusal took its turn


# what one request may cost


@pytest.fixture(scope="module")
def bounded(tiny, tmp_path_factory):
    from purerl.tinker.limits import Limits

    store = tmp_path_factory.mktemp("tinker_bounded") / "store"
    limits = Limits(max_samples=4, max_tokens=16, lora_rank=8, max_batch_tokens=40)
    with _client(service_of(tiny, store=store, limits=limits)) as client:
        yield client
        _closed(client)


def _sample(client, num_samples=1, prompt=(5, 6, 7), **params):
    return client.post("/api/v1/asample", json={
        "num_samples": num_samples, "base_model": client.service.name,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(prompt)}]},
        "sampling_params": {"max_tokens": 4, **params}})


@pytest.mark.parametrize("call, flag", [
    (lambda c: _sample(c, num_samples=5), "--max-samples"),
    (lambda c: _sample(c, num_samples=3_000_000), "--max-samples"),
    (lambda c: _sample(c, max_tokens=17), "--max-tokens"),
    (lambda c: _sample(c, prompt=[5] * 17), "--max-tokens"),
    (lambda c: _model(c, rank=9)[1], "--lora-rank"),
    (lambda c: _model(c, rank=100_000)[1], "--lora-rank"),
])
def test_a_request_past_a_limit_is_a_400_naming_the_limit_and_its_flag(bounded, call, flag):
    answer = call(bounded)
    assert answer.status_code == 400, answer.text
    assert flag in answer.json()["error"] and _one_line(answer.json()["error"])


def test_the_default_limits_bound_samples_and_lora_rank(http):
    many = _sample(http, num_samples=129)
    assert many.status_code == 400 and "at most 128 per request (--max-samples)" in many.json()["error"]
    wide = _model(http, rank=100_000)[1]
    assert wide.status_code == 400 and "up to 128 (--lora-rank)" in wide.json()["error"]


def test_requests_within_the_limits_are_served(bounded):
    samples = _result(bounded, _sample(bounded, num_samples=4, max_tokens=16, seed=1))
    assert "error" not in samples
    none = _result(bounded, _sample(bounded, num_samples=1, max_tokens=None, seed=1))  # the room, capped at 16
    assert "error" not in none
    assert "model_id" in _result(bounded, _model(bounded, rank=8)[1])
    zero = _model(bounded, rank=0)[1]
    assert zero.status_code == 400 and "at least 1" in zero.json()["error"]


# the command line: every flag checked before the model loads, in one line


class _Loaded(Exception):
    """The model loading began: the flags were not refused before it."""


def _never(*args, **kwargs):
    raise _Loaded


@pytest.mark.parametrize("flags, says", [
    (["--lora-rank", "-3"], "--lora-rank must be a whole number of at least 1, got -3"),
    (["--max-samples", "0"], "--max-samples"),
    (["--max-tokens", "-1"], "--max-tokens"),
    (["--queue-depth", "0"], "--queue-depth"),
    (["--max-batch-tokens", "0"], "--max-batch-tokens"),
    (["--lora-alpha", "0"], "--lora-alpha"),
    (["--port", "70000"], "--port 70000"),
    (["--device", "nonsense"], "--device nonsense"),
    (["--api-key", "short"], "--api-key"),
    (["--store", __file__], "a file, not a folder"),
])
def test_a_flag_the_server_cannot_honour_is_refused_at_start_in_one_line(tiny, monkeypatch, capsys, flags, says):
    monkeypatch.setattr(cli, "service_of", _never)
    assert cli.main(["--model", str(tiny), *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and _one_line(err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
def test_cuda_on_a_torch_without_it_is_refused_in_one_line(tiny, monkeypatch, capsys):
    monkeypatch.setattr(cli, "service_of", _never)
    assert cli.main(["--model", str(tiny), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "CUDA is not available to this torch" in err and _one_line(err)


def test_a_taken_port_is_refused_naming_the_port(tiny, monkeypatch, capsys):
    monkeypatch.setattr(cli, "service_of", _never)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["--model", str(tiny), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}: the port is taken" in err and _one_line(err)


# the API key: fixed across restarts on request, and a stale key told apart from a missing one


def test_a_stale_key_is_told_apart_from_a_missing_one(http):
    stale = http.post("/api/v1/create_session", json={}, headers={"X-API-Key": "tml-" + "s" * 40})
    assert stale.status_code == 401 and "not this server's key" in stale.json()["error"]
    assert "PURERL_TINKER_API_KEY" in stale.json()["error"] and "--api-key" in stale.json()["error"]
    missing = http.post("/api/v1/create_session", json={}, headers={"X-API-Key": ""})
    assert missing.status_code == 401 and "is required" in missing.json()["error"]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_key_is_fixed_by_the_flag_or_the_environment(tiny, tmp_path, monkeypatch, how):
    served = []

    class Server:
        def __init__(self, service, *, port=0, key=None):
            served.append(key)
            raise _Loaded

    monkeypatch.setattr(cli, "TinkerServer", Server)
    monkeypatch.setattr(cli, "service_of", lambda *a, **k: None)
    flags = ["--api-key", KEY] if how == "flag" else []
    if how == "env":
        monkeypatch.setenv("PURERL_TINKER_API_KEY", KEY)
    with pytest.raises(_Loaded):
        cli.main(["--model", str(tiny), "--store", str(tmp_path), *flags])
    assert served == [KEY]


# a folder written whole replaces the old one only once the new one is in place


def test_whole_folder_keeps_the_old_folder_when_the_new_one_cannot_take_its_name(tmp_path, monkeypatch):
    from purerl.files import whole_folder

    old = tmp_path / "export"
    old.mkdir()
    (old / "weights").write_text("old")
    rename = Path.rename

    def failing(self, target):
        if self.name.startswith(".tmp_"):
            raise OSError("the disk went away")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(OSError, match="the disk went away"), whole_folder(old) as folder:
        (folder / "weights").write_text("new")
    assert (old / "weights").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing left beside it
    (tmp_path / "a-file").write_text("mine")
    with pytest.raises(FileExistsError, match="not a folder"), whole_folder(tmp_path / "a-file"):
        pass
    assert (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
def test_a_datum_past_max_tokens_is_a_400_through_the_sdk_and_the_models_next_call_runs(bounded, monkeypatch):
    import gc
    import warnings

    import tinker
    from tinker import types

    from purerl.tinker.server import TinkerServer

    monkeypatch.setenv("TINKER_TELEMETRY", "0")

    def datum(n):
        tokens = [5 + i % 20 for i in range(n + 1)]
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                           loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n})

    with TinkerServer(bounded.service, key=KEY, poll_seconds=5.0) as server:
        client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        training = client.create_lora_training_client(base_model=server.service.name, rank=4).result()
        with pytest.raises(tinker.BadRequestError, match="datum 1's model_input length 17: .*--max-tokens"):
            training.forward_backward([datum(4), datum(17)], "cross_entropy").result()
        with pytest.raises(tinker.BadRequestError, match="forward_backward of 48 tokens: .*--max-batch-tokens"):
            training.forward_backward([datum(16)] * 3, "cross_entropy").result()  # each datum within --max-tokens
        assert training.forward_backward([datum(16)], "cross_entropy").result().metrics["loss:sum"] > 0
        client.close("success").result()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        del client, training
        gc.collect()


def test_an_unknown_session_is_not_found_and_an_odd_id_is_no_server_error(http):
    assert http.post("/api/v1/sessions/never-opened/finish").status_code == 404
    assert "never-opened" not in http.service.sessions
    odd = http.post("/api/v1/session_heartbeat", json={"session_id": ["a", "list"]})
    assert odd.status_code == 404 and _one_line(odd.json()["error"])
