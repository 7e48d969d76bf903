"""Image content parts of chat requests on the server: counted against the limit before anything is decoded,
loaded under the served engine's media policy (data URLs always; local files under ``--allowed-local-media-path``;
http(s) only from hosts named with ``--allowed-media-domains``, so by default nothing reaches the network) and
processed into the prompt with the model's own image processor.

Runs in the request's worker thread, like tokenizing. Every problem of the client's making is a 400 naming it:
an image for a text-only model, too many images, bytes that are not an image (or are truncated), an image with
more pixels than the server decodes, a placeholder token without an image.
"""

from lockstep.engine.multimodal import MultimodalInputs
from lockstep.multimodal.media import load_image
from lockstep.multimodal.processor import placeholder_runs
from lockstep.server.protocol import APIError
from lockstep.server.state import ServerState


def check_image_count(state: ServerState, num_images: int) -> None:
    """400 for images sent to a text-only model, or more than ``--limit-mm-per-prompt`` allows (before any is
    decoded)."""
    if not num_images:
        return
    engine = state.engine.engine
    if not engine.is_multimodal:
        raise APIError(
            400, f"the model '{state.model_name}' is text-only: it takes no image content parts", param="messages"
        )
    limit = (engine.config.limit_mm_per_prompt or {}).get("image")
    if limit is not None and num_images > limit:
        raise APIError(
            400,
            f"the messages hold {num_images} images; this server takes at most {limit} per prompt "
            "(--limit-mm-per-prompt)",
            param="messages",
        )


def image_prompt(
    state: ServerState, ids: list[int], sources: list[object], mm_processor_kwargs: dict | None = None
) -> tuple[list[int], MultimodalInputs | None]:
    """The prompt's token ids with its image placeholders expanded, and its images' inputs (None without images);
    400 for a bad image or placeholders that do not match the images. ``mm_processor_kwargs``: the request's
    min/max pixels, at most the server's own maximum (a client cannot make its images larger than the server
    would)."""
    engine = state.engine.engine
    if not engine.is_multimodal:
        return ids, None
    if not sources:
        token = engine.runner.model.mm_config.image_token_id
        if placeholder_runs(ids, token):
            raise APIError(400, "the prompt holds an image placeholder (<|image_pad|>) but no image", param="messages")
        return ids, None
    check_image_count(state, len(sources))
    kwargs = _request_kwargs(state, mm_processor_kwargs)
    policy = engine.media_policy
    try:
        images = [load_image(source, policy) for source in sources]
        return engine.process_images(ids, images, kwargs)
    except ValueError as e:  # MediaError included
        raise APIError(400, f"invalid image: {e}", param="messages") from None


def _request_kwargs(state: ServerState, kwargs: dict | None) -> dict | None:
    """A request's ``mm_processor_kwargs``, checked: ``min_pixels`` / ``max_pixels`` as integers >= 1, neither above
    the largest image area the server's processor resizes to."""
    if not kwargs:
        return None
    if not isinstance(kwargs, dict):
        raise APIError(400, "mm_processor_kwargs must be an object", param="mm_processor_kwargs")
    processor = state.engine.engine.image_processor
    most = processor.max_pixels
    for name, value in kwargs.items():
        if name not in ("min_pixels", "max_pixels"):
            raise APIError(
                400, f"mm_processor_kwargs takes min_pixels and max_pixels, not {name!r}", param="mm_processor_kwargs"
            )
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
            raise APIError(
                400,
                f"mm_processor_kwargs.{name} must be an integer in [1, {most}] (the server's max_pixels), "
                f"got {value!r}",
                param="mm_processor_kwargs",
            )
    return kwargs
