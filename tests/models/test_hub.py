"""Hugging Face model ids: resolved from a cache laid out the way ``huggingface_hub`` lays it out (built here from a
tiny checkpoint), with ``HF_HOME`` pointed at a temporary folder; offline, or with a Hub that cannot be reached. The
FP8 checkpoint formats load from ids as from folders."""

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from fp8_checkpoints import save_fp8

from lockstep.cli import main
from lockstep.llm import LLM
from lockstep.models.hub import hub_cache_dir, resolve_model
from lockstep.ops import fp8
from lockstep.sampling_params import SamplingParams

REPO = "lockstep-test/tiny-llama"
MAIN = "a" * 40  # commit hashes
OTHER = "b" * 40


def add_snapshot(cache: Path, repo: str, commit: str, source: Path, refs: tuple[str, ...] = ()) -> Path:
    """Put ``source``'s files into ``cache`` as huggingface_hub does: the contents in ``blobs/``, the snapshot a
    folder of relative symlinks to them, ``refs/<name>`` holding the commit."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        blob = root / "blobs" / f"{commit[:8]}-{file.name}"  # real blobs are named by their hash
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> Path:
    """``HF_HOME`` at a fresh folder whose hub cache holds REPO at ``main`` (and at tag ``v2``, another commit)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf" / "hub"
    assert hub_cache_dir() == cache
    add_snapshot(cache, REPO, MAIN, tiny_model_dir, refs=("main",))
    add_snapshot(cache, REPO, OTHER, tiny_model_dir, refs=("v2",))
    return tmp_path / "hf"


def greedy(llm: LLM) -> list[int]:
    [out] = llm.generate([[5, 17, 42, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    return out.token_ids


def test_a_model_id_resolves_to_its_cached_snapshot(hf_home: Path, tiny_model_dir: Path) -> None:
    snapshots = hf_home / "hub" / "models--lockstep-test--tiny-llama" / "snapshots"
    assert Path(resolve_model(REPO)) == snapshots / MAIN
    assert Path(resolve_model(REPO, revision="v2")) == snapshots / OTHER
    assert Path(resolve_model(REPO, revision=OTHER)) == snapshots / OTHER
    llm = LLM(REPO, block_size=4, num_kv_blocks=64)
    assert Path(llm.engine.config.model) == snapshots / MAIN and llm.engine.config.revision is None
    assert llm.tokenizer is not None
    assert greedy(llm) == greedy(LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=64))
    assert Path(LLM(REPO, revision="v2", block_size=4, num_kv_blocks=64).engine.config.model) == snapshots / OTHER


def test_a_cached_id_resolves_when_the_hub_cannot_be_reached(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Not offline by flag: the Hub is tried (a closed local port refuses at once) and the cache answers.
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    assert Path(resolve_model(REPO)).name == MAIN
    with pytest.raises(FileNotFoundError) as err:
        resolve_model("lockstep-test/not-cached")
    message = str(err.value)
    assert "'lockstep-test/not-cached'" in message and str(hf_home / "hub") in message
    assert "downloading failed" in message


def test_a_missing_id_names_the_id_and_the_cache(hf_home: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        LLM("lockstep-test/not-cached")
    message = str(err.value)
    assert "'lockstep-test/not-cached' (revision main)" in message and str(hf_home / "hub") in message
    assert "HF_HUB_OFFLINE is set" in message
    with pytest.raises(FileNotFoundError, match=r"revision nope\) is not a folder"):
        resolve_model(REPO, revision="nope")


def test_folders_keep_working_and_take_no_revision(hf_home: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    assert resolve_model(str(tiny_model_dir)) == str(tiny_model_dir)
    with pytest.raises(ValueError, match="revision='v2' applies to Hugging Face model ids"):
        LLM(str(tiny_model_dir), revision="v2")
    with pytest.raises(FileNotFoundError, match="model folder .* does not exist"):
        resolve_model(str(tmp_path / "no" / "such" / "folder"))
    with pytest.raises(ValueError, match="needs a Hugging Face model id"):
        LLM(None, revision="v2")


def test_cli_generate_and_serve_take_a_model_id(
    hf_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    assert main(["generate", "ab", "--model", REPO, "--revision", "v2", "--raw", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()
    # serve resolves the id before the server fingerprints the folder, and serves it under the id.
    import lockstep.server.openai_api
    import lockstep.server.state

    seen = {}

    class State:
        model_name, fingerprint = REPO, "fp"
        engine = SimpleNamespace(limits=None)  # serve sets the load limits on it

    def create_state(model, **kwargs):
        seen.update(model=model, name=kwargs["served_model_name"])
        return State()

    monkeypatch.setattr(lockstep.server.state, "create_state", create_state)
    monkeypatch.setattr(lockstep.server.openai_api, "serve", lambda *args, **kwargs: 0)
    any_port = ["--port", "0"]  # serve binds its port before it loads: not 8000, which may be taken
    assert main(["serve", REPO, *any_port]) == 0
    assert Path(seen["model"]).name == MAIN and seen["name"] == REPO
    assert main(["serve", REPO, "--served-model-name", "tiny", *any_port]) == 0 and seen["name"] == "tiny"
    assert main(["serve", "lockstep-test/not-cached", *any_port]) == 2
    assert "'lockstep-test/not-cached'" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel", "ct-tensor", "ct-block", "online"])
def test_fp8_checkpoints_load_from_model_ids(hf_home: Path, tiny_model_dir: Path, tmp_path: Path, layout: str):
    # Each FP8 format (and online FP8 of a full-precision id), offline from the cache layout: the folder's bits.
    kwargs = {"quantization": "fp8"} if layout == "online" else {}
    folder = tiny_model_dir if layout == "online" else save_fp8(tiny_model_dir, tmp_path / layout, layout)
    repo = REPO if layout == "online" else f"lockstep-test/tiny-{layout}"
    if layout != "online":
        add_snapshot(hf_home / "hub", repo, MAIN, folder, refs=("main",))
    llm = LLM(repo, block_size=4, num_kv_blocks=64, **kwargs)
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == fp8.FP8
    assert greedy(llm) == greedy(LLM(str(folder), block_size=4, num_kv_blocks=64, **kwargs))


def test_a_vision_language_model_loads_from_its_id(hf_home: Path, tmp_path: Path) -> None:
    # A Qwen3-VL checkpoint (weights, tokenizer, image processor) from the cache layout: the folder's bits for an
    # image request.
    from tiny_vlm import IMAGE_PLACEHOLDER, save_tiny_vlm, tiny_image

    folder = save_tiny_vlm(tmp_path / "tiny-qwen3-vl", "qwen3_vl")
    add_snapshot(hf_home / "hub", "lockstep-test/tiny-qwen3-vl", MAIN, folder, refs=("main",))
    prompt = {"prompt": f"Look: {IMAGE_PLACEHOLDER} what?", "multi_modal_data": {"image": tiny_image(64, 48)}}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)

    def run(model: str):
        [out] = LLM(model, block_size=4, num_kv_blocks=64).generate([prompt], params)
        choice = out.outputs[0]
        return choice.token_ids, [lp[t].logprob for lp, t in zip(choice.logprobs, choice.token_ids, strict=True)]

    assert run("lockstep-test/tiny-qwen3-vl") == run(str(folder))
