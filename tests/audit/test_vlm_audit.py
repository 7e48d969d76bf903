"""The local audit with an image: the same image and question in every target, among image and text fillers."""

from pathlib import Path

from tiny_vlm import save_tiny_vlm, tiny_image

from lockstep.audit.runner import AuditConfig, _schedule, audit_local


def test_local_image_audit_gives_one_completion(tmp_path: Path) -> None:
    folder = save_tiny_vlm(tmp_path / "vl", "qwen3_vl")
    tiny_image(96, 64, 1).save(tmp_path / "cat.png")
    cfg = AuditConfig(
        prompt="Describe this image.", n=6, concurrency=(1, 6), max_tokens=6, temperature=0.8, seed=2, filler=4,
        image=str(tmp_path / "cat.png"),
    )  # fmt: skip
    assert cfg.chat and cfg.params()["image"] == str(tmp_path / "cat.png")
    items = _schedule(cfg, 6)
    with_images = [c for _, c in items if isinstance(c, list)]
    assert len(with_images) == 6 + 2  # the targets and every other filler
    report = audit_local(str(folder), cfg, device="cpu", progress=False)
    inv = report["modes"]["invariant"]["overall"]
    assert (inv["requests"], inv["unique_completions"]) == (12, 1) and inv["logprobs"]["bitwise_identical"]
    assert report["modes"]["default"]["overall"]["requests"] == 12
