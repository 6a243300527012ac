"""FastWeightsConfig: the Hugging Face `PreTrainedConfig` of a fastweights LM.

It carries the whole LMConfig as a JSON dict under `config`, next to `format`, `version` and
`backends` (the backend each layer requested, "auto" or a name): exactly the keys `LM.save_pretrained` writes into
`config.json` (which also writes `"model_type": "fastweights"`), so one directory is both a
fastweights checkpoint and a transformers one. The usual transformers names (`vocab_size`, `hidden_size`,
`num_hidden_layers`, `num_attention_heads`) are views of the LMConfig's `vocab_size`, `d_model`,
`n_layers`, `num_heads` (None while it has none); writing one writes the LMConfig (validated).

`FastWeightsConfig()` (no arguments) is a valid, empty config: transformers builds one to learn the
defaults (`to_diff_dict`, generation parameters) and validates it (5.17 – 5.19 read `vocab_size` in
`validate_token_ids`); only `.lm_config` and building a model need the LMConfig.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from ..models.checkpoint import AUTO_MAP, FORMAT, VERSION, requested_backends
from ..models.config import ConfigError, LMConfig

__all__ = ["FastWeightsConfig", "MODEL_TYPE"]

MODEL_TYPE = "fastweights"


class FastWeightsConfig(PretrainedConfig):
    """A fastweights LM for transformers: `config` is `LMConfig.to_dict()` (validated on creation).

    FastWeightsConfig(lm_config) takes an LMConfig or its dict; `.lm_config` rebuilds the LMConfig.
    """

    model_type = MODEL_TYPE

    def __init__(self, config: dict[str, Any] | LMConfig | None = None, format: str = FORMAT,
                 version: int = VERSION, backends: list[str] | None = None, routing: str | None = None,
                 **kwargs):
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
        # the backend every layer requested (what LM.save_pretrained records); None: the LMConfig's.
        # routing: ROUTING, or None for a config.json written before calls were routed per call, whose
        # backends were resolved names (`checkpoint.requested_backends` reads those as the LMConfig's)
        self.backends = list(backends) if backends is not None else None
        self.routing = routing
        kwargs.setdefault("tie_word_embeddings", False)  # the LM's head reads the embedding itself
        # loadable with trust_remote_code=True before `import fastweights.hf` (checkpoint.AUTO_MAP)
        kwargs.setdefault("auto_map", dict(AUTO_MAP))
        super().__init__(**kwargs)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """Nothing: transformers calls this after loading through `auto_map` (trust_remote_code=True), to copy
        the class's source file into every directory it saves later; the class lives in the installed
        package, and the file `auto_map` names (`checkpoint.AUTO_MODULE`) is written by every save."""

    def requested_backends(self) -> list[str] | None:
        """The backend each layer requests (None without an LMConfig): see `checkpoint.requested_backends`."""
        if self.config is None:
            return None
        return requested_backends(self.backends, self.routing, self.lm_config)

    @property
    def lm_config(self) -> LMConfig:
        if self.config is None:
            raise ConfigError("FastWeightsConfig without an LMConfig (config=None): give config=LMConfig(...)")
        return LMConfig.from_dict(self.config)

    def _field(self, name: str) -> int | None:
        return None if self.config is None else self.config[name]

    def _set_field(self, name: str, flat: str, value) -> None:
        """Write one LMConfig field through its transformers name (validated: a ConfigError names it)."""
        if self.config is None:
            raise ConfigError(f"FastWeightsConfig.{flat} = {value!r}: this config has no LMConfig to write it into "
                             "(give config=LMConfig(...))")
        new = {**self.config, name: value}
        LMConfig.from_dict(new)
        self.config = new

    # transformers' names of four LMConfig fields, readable and writable (None without an LMConfig)
    vocab_size = property(lambda self: self._field("vocab_size"),
                          lambda self, v: self._set_field("vocab_size", "vocab_size", v))
    hidden_size = property(lambda self: self._field("d_model"),
                           lambda self, v: self._set_field("d_model", "hidden_size", v))
    num_hidden_layers = property(lambda self: self._field("n_layers"),
                                 lambda self, v: self._set_field("n_layers", "num_hidden_layers", v))
    num_attention_heads = property(lambda self: self._field("num_heads"),
                                   lambda self, v: self._set_field("num_heads", "num_attention_heads", v))
