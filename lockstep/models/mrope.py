"""M-RoPE position ids of a prompt with images (transformers' ``get_rope_index`` for images), and the delta that
places every later token.

Text tokens count up by one, all three components (t, h, w) equal. An image of ``h' x w'`` merged tokens starting
at position p takes t = p, h = p + row, w = p + column (row-major, the order of its image tokens), and the text after
it continues at ``p + max(h', w')``. So positions grow more slowly than token indices; ``delta`` (negative when the
prompt has images) is the difference: the token at index ``i >= len(prompt)`` sits at ``i + delta`` in all three
components, which is how decode steps and chunks past the last image get their positions without the prompt.
"""

import torch

from lockstep.models.multimodal import MultimodalConfig


def mrope_positions(
    mm: MultimodalConfig, prompt_token_ids: list[int], image_grid_thw: list[tuple[int, int, int]]
) -> tuple[torch.Tensor, int]:
    """``(positions [3, len(prompt)] int64, delta)``. Each maximal run of ``mm.image_token_id`` tokens is the next
    image of ``image_grid_thw`` (its ``t * h * w // merge**2`` tokens, as the image processor's grids say);
    ValueError when the runs and the grids do not match."""
    merge = mm.spatial_merge_size
    grids = [tuple(int(x) for x in g) for g in image_grid_thw]
    columns: list[torch.Tensor] = []
    pos = 0
    image = 0
    n = len(prompt_token_ids)
    i = 0
    while i < n:
        is_image = prompt_token_ids[i] == mm.image_token_id
        j = i
        while j < n and (prompt_token_ids[j] == mm.image_token_id) == is_image:
            j += 1
        if not is_image:
            columns.append(torch.arange(pos, pos + j - i, dtype=torch.int64).expand(3, -1))
            pos += j - i
        else:
            if image >= len(grids):
                raise ValueError(f"the prompt has more image-token runs than the {len(grids)} image grid(s) given")
            t, h, w = grids[image]
            if h % merge or w % merge:
                raise ValueError(f"image grid {grids[image]} is not a multiple of the merge size {merge}")
            th, tw = h // merge, w // merge
            if j - i != t * th * tw:
                raise ValueError(
                    f"image {image}: {j - i} image tokens in the prompt, but its grid {grids[image]} makes "
                    f"{t * th * tw}"
                )
            tt, hh, ww = torch.meshgrid(
                torch.arange(t, dtype=torch.int64), torch.arange(th), torch.arange(tw), indexing="ij"
            )
            columns.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos += max(th, tw)
            image += 1
        i = j
    if image != len(grids):
        raise ValueError(f"{len(grids)} image grid(s) given, but the prompt has {image} image-token run(s)")
    positions = torch.cat(columns, dim=1) if columns else torch.zeros((3, 0), dtype=torch.int64)
    delta = (int(positions.max()) + 1 - n) if n else 0
    return positions, delta
