"""treetune: tune EAGLE3 speculative-decoding trees for SGLang servers."""

from treetune.config import BASELINE, Baseline, ServerConfig, TreeConfig

__all__ = ["BASELINE", "Baseline", "ServerConfig", "TreeConfig"]
__version__ = "0.1.0"
