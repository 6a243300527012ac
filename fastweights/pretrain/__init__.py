"""Language-model pretraining on one's own text (`fastweights train`): data (text or token files,
packed windows honouring documents), the configuration (presets, JSON/TOML, flags) and the loop
(AdamW, cosine schedule, bf16, accumulation, clipping, validation, checkpoints with exact resume,
DDP / FSDP2 under torchrun)."""

from .config import PRESETS, ConfigFileError, PretrainConfig, load_config_file
from .data import DataError, Windows, load_tokenizer, read_stream, split_stream
from .loop import train
from .rundir import OutputError

__all__ = ["PretrainConfig", "PRESETS", "ConfigFileError", "load_config_file", "DataError", "OutputError", "Windows",
           "load_tokenizer", "read_stream", "split_stream", "train"]
