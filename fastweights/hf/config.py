"""FastWeightsConfig: the Hugging Face `PreTrainedConfig` of a fastweights LM.

It carries the whole LMConfig as a JSON dict under `config`, next to `format`, `version` and
`backends` (the backend each layer ran): exactly the keys `LM.save_pretrained` writes into
`config.json` (which also writes `"model_type": "fastweights"`), so one directory is both a
fastweights checkpoint and a transformers one. The usual transformers names (`vocab_size`, `hidden_size`,
`num_hidden_layers`, `num_attention_heads`) are read-only views of the LMConfig.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from ..models.checkpoint import FORMAT, VERSION
from ..models.config import ConfigError, LMConfig

__all__ = ["FastWeightsConfig", "MODEL_TYPE"]

MODEL_TYPE = "fastweights"


class FastWeightsConfig(PretrainedConfig):
    """A fastweights LM for transformers: `config` is `LMConfig.to_dict()` (validated on creation).

    FastWeightsConfig(lm_config) takes an LMConfig or its dict; `.lm_config` rebuilds the LMConfig.
    """

    model_type = MODEL_TYPE

    def __init__(self, config: dict[str, Any] | LMConfig | None = None, format: str = FORMAT,
                 version: int = VERSION, backends: list[str] | None = None, **kwargs):
        if isinstance(config, LMConfig):
            config = config.to_dict()
        if config is not None:
            LMConfig.from_dict(config)  # ConfigError naming the field
        if format != FORMAT:
            raise ConfigError(f"format must be {FORMAT!r}, got {format!r}")
        if version != VERSION:
            raise ConfigError(f"checkpoint version {version!r}: this library reads {VERSION}")
        self.config = config
        self.format = format
        self.version = version
        # the backend every layer ran (what LM.save_pretrained records); None: resolve config's
        self.backends = list(backends) if backends is not None else None
        kwargs.setdefault("tie_word_embeddings", False)  # the LM's head reads the embedding itself
        super().__init__(**kwargs)

    @property
    def lm_config(self) -> LMConfig:
        if self.config is None:
            raise ConfigError("FastWeightsConfig without an LMConfig (config=None): give config=LMConfig(...)")
        return LMConfig.from_dict(self.config)

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"] if self.config is not None else None

    @property
    def hidden_size(self) -> int:
        return self.config["d_model"] if self.config is not None else None

    @property
    def num_hidden_layers(self) -> int:
        return self.config["n_layers"] if self.config is not None else None

    @property
    def num_attention_heads(self) -> int:
        return self.config["num_heads"] if self.config is not None else None
