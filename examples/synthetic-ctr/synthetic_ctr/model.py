"""The dense tower shared by every system, so that only the embedding path differs between runs.

``CTRTower.forward(non_id_tensors, embedding_tensors)`` is PERSIA's model signature: a list with the
(bs, 13) dense tensor and a list of 26 (bs, 16) pooled embeddings; baselines pass their own lists.
"""

from __future__ import annotations

import torch
from torch import nn

from synthetic_ctr.schema import NUM_DENSE, NUM_SLOTS

EMBEDDING_DIM = 16
MLP_PRESETS: dict[str, tuple[int, ...]] = {
    "mlp400": (400, 400, 400),
    "ffnn": (4096, 2048, 1024, 512, 256),  # PERSIA's benchmark FFNN
}


def parse_hidden(spec: str) -> tuple[int, ...]:
    """'mlp400' / 'ffnn' or a comma list like '400,400,400'."""
    if spec in MLP_PRESETS:
        return MLP_PRESETS[spec]
    try:
        sizes = tuple(int(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"mlp must be one of {sorted(MLP_PRESETS)} or 'a,b,c', got mlp={spec!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"mlp needs positive layer sizes, got mlp={spec!r}")
    return sizes


class CTRTower(nn.Module):
    def __init__(self, hidden: tuple[int, ...], embedding_dim: int = EMBEDDING_DIM, num_slots: int = NUM_SLOTS):
        super().__init__()
        layers: list[nn.Module] = []
        width = NUM_DENSE + num_slots * embedding_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, non_id_tensors: list[torch.Tensor], embedding_tensors: list[torch.Tensor]) -> torch.Tensor:
        """Click probability (bs, 1)."""
        x = torch.cat([non_id_tensors[0], *embedding_tensors], dim=1)
        return torch.sigmoid(self.mlp(x))

    def forward_flat(self, dense: torch.Tensor, flat_embeddings: torch.Tensor) -> torch.Tensor:
        """Same as forward, with embeddings already concatenated (bs, 26 * dim)."""
        return torch.sigmoid(self.mlp(torch.cat([dense, flat_embeddings], dim=1)))
