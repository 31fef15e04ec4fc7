"""PERSIA's adult-income DNN: a dense tower, an embedding tower, and an MLP on both.

``num_slots`` = 8 categorical + 5 bucketised continuous ID slots (see adult.py)."""

from typing import List

import torch
from torch import nn


class DNN(nn.Module):
    def __init__(self, dense_dim: int = 5, num_slots: int = 13, emb_dim: int = 8):
        super().__init__()
        self.dense = nn.Sequential(nn.Linear(dense_dim, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.sparse = nn.Sequential(nn.Linear(num_slots * emb_dim, 128), nn.BatchNorm1d(128), nn.ReLU())
        self.mlp = nn.Sequential(
            nn.Linear(16 + 128, 256), nn.ReLU(),
            nn.Linear(256, 128), nn.ReLU(),
            nn.Linear(128, 1),
        )

    def forward(self, non_id_tensors: List[torch.Tensor], embedding_tensors: List[torch.Tensor]) -> torch.Tensor:
        d = self.dense(non_id_tensors[0].float())
        s = self.sparse(torch.cat(embedding_tensors, dim=1).float())
        return torch.sigmoid(self.mlp(torch.cat([d, s], dim=1)))
