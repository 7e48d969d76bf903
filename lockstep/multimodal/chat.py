"""Chat messages with image content parts, as the chat template reads them and as the images are found.

OpenAI's parts (``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url": {"url": ...}}``, the url
also as a plain string) and the offline forms (``{"type": "image", "image": PIL.Image}``, vLLM's ``image_pil``).
A message whose parts are all text becomes one string, as before images existed; one with images keeps its parts,
images as ``{"type": "image"}``, which Qwen-VL templates render as ``<|vision_start|><|image_pad|><|vision_end|>``.
"""

from typing import Any

IMAGE_PART_TYPES = ("image_url", "image", "image_pil")


def has_images(content: Any) -> bool:
    """Whether a message's content holds an image part."""
    return isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in content)


def split_content(content: Any) -> tuple[str | list[dict], list[object]]:
    """A message's content for the template, and its image sources (URL strings or PIL images) in order. Raises
    ValueError for a part it does not know."""
    if content is None or isinstance(content, str):
        return content or "", []
    if not isinstance(content, list):
        raise ValueError(f"message content must be a string or a list of content parts, got {type(content).__name__}")
    parts: list[dict] = []
    sources: list[object] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i}: a text part needs a string 'text'")
            parts.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_PART_TYPES:
            sources.append(_image_source(part, kind, i))
            parts.append({"type": "image"})
        else:
            raise ValueError(
                f"content part {i}: unsupported type {kind!r} (text, image_url, image and image_pil are supported)"
            )
    if not sources:
        return "".join(p["text"] for p in parts), []
    return parts, sources


def _image_source(part: dict, kind: str, i: int) -> object:
    value = part.get(kind)
    if kind == "image_url":
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise ValueError(f"content part {i}: an image_url part needs image_url.url, a URL string")
        return url
    if value is None:
        raise ValueError(f"content part {i}: an {kind} part needs its {kind!r} value")
    return value


def text_chars(content: str | list[dict]) -> int:
    """The characters of a template content's text (its images excluded)."""
    if isinstance(content, str):
        return len(content)
    return sum(len(p["text"]) for p in content if p["type"] == "text")
