"""EAGLE-3 heads as they are published: ``pytorch_model.bin`` weights, read tensors-only (the same proposals and
bits as the same head in safetensors; a pickle that names anything but tensors is refused by name and never runs),
the config variants heads ship with (``Eagle3LlamaForCausalLM``, a full draft vocabulary without ``d2t``,
``target_hidden_size``), and the hub fetch of a head repo whose only weights are a ``.bin``."""

import fnmatch
import json
import shutil
from pathlib import Path

import pytest
import test_eagle3
import torch
from safetensors.torch import load_file
from test_eagle3 import GREEDY, PROMPTS, SEEDED, _bits, _llm, _recording, _reference_drafts, eagle3_config, random_head
from tiny_models import TINY_VOCAB

from lockstep.models.eagle3 import load_eagle3, resolve_head
from lockstep.models.loader import load_model
from lockstep.models.torch_bin import load_bin

target_dir, head_dir = test_eagle3.target_dir, test_eagle3.head_dir


def save_bin_head(folder: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(eagle3_config(**config)))
    torch.save(tensors, folder / "pytorch_model.bin")
    return folder


def test_a_bin_head_drafts_what_its_safetensors_twin_does(target_dir: Path, head_dir: Path, tmp_path: Path) -> None:
    tensors = load_file(head_dir / "model.safetensors")
    bin_dir = save_bin_head(tmp_path / "bin", {f"model.{k}" if k == "fc.weight" else k: v for k, v in tensors.items()})
    runs = []
    for head in (head_dir, bin_dir):
        llm = _llm(target_dir, head, k=3, enable_prefix_caching=False)
        calls = _recording(llm)
        runs.append((_bits(llm.generate(PROMPTS, [GREEDY, SEEDED] * 2, use_tqdm=False)), calls))
    assert runs[0] == runs[1]
    calls = runs[0][1]
    assert len(calls) >= 2 * len(PROMPTS) and len({tuple(p) for _, _, p in calls}) > len(calls) // 2
    assert runs[0][0] == _bits(_llm(target_dir, None).generate(PROMPTS, [GREEDY, SEEDED] * 2, use_tqdm=False))


def _touch(path: str) -> None:
    Path(path).touch()


class _RunsCode:
    """Unpickling this calls ``_touch(marker)``: what a malicious checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch, (self.marker,))


def test_a_bin_that_needs_more_than_tensors_is_refused_unrun(target_dir: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    tensors = random_head(3)
    folder = save_bin_head(tmp_path / "evil", tensors | {"extra": _RunsCode(marker)})
    target = load_model(target_dir)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: refused.*names .*_touch"):
        load_eagle3(folder, target, target.kernels, 64)
    assert not marker.exists()
    torch.load(folder / "pytorch_model.bin", weights_only=False)  # the control: a full unpickle runs it
    assert marker.exists()


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ({"step": 3}, "entry 'step' is a int"),
        ({"state_dict": {"fc.weight": torch.ones(2)}}, "entry 'state_dict' is a dict"),
        ([torch.ones(2)], "holds a list"),
    ],
    ids=["int", "nested", "list"],
)
def test_a_bin_of_plain_values_that_are_not_tensors_is_refused(tmp_path: Path, content, match: str) -> None:
    file = tmp_path / "pytorch_model.bin"
    torch.save(content if not isinstance(content, dict) else random_head(3) | content, file)
    with pytest.raises(ValueError, match=f"{file}: .*{match}"):
        load_bin(file)


def test_a_bin_that_is_not_a_pickle_is_a_value_error(tmp_path: Path) -> None:
    file = tmp_path / "pytorch_model.bin"
    file.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        load_bin(file)


@pytest.mark.parametrize(
    "config",
    [
        {"architectures": ["Eagle3LlamaForCausalLM"], "draft_vocab_size": TINY_VOCAB},
        {"draft_vocab_size": None, "target_hidden_size": 64},
        {"draft_vocab_size": TINY_VOCAB, "target_hidden_size": None, "torch_dtype": "float16"},
    ],
    ids=["Eagle3LlamaForCausalLM", "target_hidden_size", "no-d2t"],
)
def test_published_config_variants_load_and_draft_the_head(target_dir: Path, tmp_path: Path, config: dict) -> None:
    """A full draft vocabulary without d2t / t2d (ids are target ids), the architecture's other name, an explicit
    target_hidden_size, a checkpoint dtype other than the target's (the target's is used): the proposals are the
    reference forward of the head with the identity vocabulary map."""
    from transformers import AutoModelForCausalLM

    tensors = random_head(11, vocab=TINY_VOCAB)
    del tensors["d2t"], tensors["t2d"]
    llm = _llm(target_dir, save_bin_head(tmp_path / "head", tensors, **config), k=2, enable_prefix_caching=False)
    head = llm.engine.drafter.head
    assert torch.equal(head.to_target(torch.arange(TINY_VOCAB)), torch.arange(TINY_VOCAB))
    calls = _recording(llm)
    llm.generate(PROMPTS[:2], SEEDED, use_tqdm=False)
    target_hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    w = tensors | {"d2t": torch.zeros(TINY_VOCAB, dtype=torch.int64)}
    assert len(calls) >= 4
    for tokens, k, proposal in calls:
        assert proposal == _reference_drafts(target_hf, w, tokens, k), tokens


def test_a_hub_head_with_only_a_bin_fetches_it(head_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """The hub is faked by a snapshot_download that copies a repo's files matching ``allow_patterns``: a head repo
    without safetensors is fetched again with pytorch_model.bin allowed; one with safetensors never gets its .bin."""
    import huggingface_hub

    repos = {"org/bin-head": tmp_path / "repo-bin", "org/st-head": tmp_path / "repo-st"}
    save_bin_head(repos["org/bin-head"], load_file(head_dir / "model.safetensors"))
    shutil.copytree(head_dir, repos["org/st-head"])
    shutil.copy(repos["org/bin-head"] / "pytorch_model.bin", repos["org/st-head"])
    calls = []

    def snapshot_download(repo_id, allow_patterns, **kwargs):
        calls.append((repo_id, tuple(allow_patterns)))
        out = tmp_path / "snapshots" / repo_id / str(len(calls))
        out.mkdir(parents=True)
        for f in repos[repo_id].iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, out)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    got = Path(resolve_head("org/bin-head"))
    assert (got / "pytorch_model.bin").is_file() and (got / "config.json").is_file()
    assert [("pytorch_model.bin" in p) for _, p in calls] == [False, True]
    calls.clear()
    got = Path(resolve_head("org/st-head"))
    assert len(calls) == 1 and not (got / "pytorch_model.bin").exists() and (got / "model.safetensors").is_file()
