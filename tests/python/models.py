"""Small models for the offload tests: a hand-written decoder block stack and
nn.TransformerEncoder, both deterministic on CPU (no dropout)."""

from __future__ import annotations

import math

import torch
from torch import nn


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention + MLP, written out op by op."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q, k, v = self.qkv(h).split(d, dim=-1)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        att = scores.softmax(dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class DecoderStack(nn.Module):
    def __init__(self, layers: int = 4, dim: int = 64, heads: int = 4, vocab: int = 97) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderBlock(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def transformer_encoder(layers: int = 3, dim: int = 64) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers)


def tokens(batch: int = 4, length: int = 32, vocab: int = 97) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length))


def fsdp_decoder_and_adamw():
    """A 2-layer DecoderStack sharded with FSDP2 (``fully_shard`` per layer
    and at the root; needs an initialized process group), and AdamW over it.
    The same initial weights on every call (seed 0)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = DecoderStack(layers=2, dim=64, heads=4)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def local_copies(sd, prefix: str = ""):
    """{dotted key: a copy of the tensor, a DTensor's local shard} of a nested
    state dict, for bit-for-bit comparisons."""
    out = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(local_copies(v, f"{prefix}{k}."))
    elif isinstance(sd, torch.Tensor):
        local = sd.to_local() if hasattr(sd, "to_local") else sd
        out[prefix[:-1]] = local.detach().clone()
    return out
