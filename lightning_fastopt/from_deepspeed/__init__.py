"""Coming from DeepSpeed (issue 69): Lightning's ``DeepSpeedStrategy`` arguments and
DeepSpeed's config files taken by our strategies (docs/from_deepspeed.md)."""

from lightning_fastopt.from_deepspeed.arguments import DEEPSPEED_WORDS, FromDeepSpeed, from_deepspeed
from lightning_fastopt.from_deepspeed.config import DeepSpeedConfig, read_config

__all__ = ["DEEPSPEED_WORDS", "DeepSpeedConfig", "FromDeepSpeed", "from_deepspeed", "read_config"]
