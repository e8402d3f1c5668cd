"""Push train.py checkpoints to the Hugging Face Hub and create models from Hub repos with timm."""
from .errors import HubError
from .pull import create_model_from_hub
from .push import FLOAT32_PARAM_NAMES, push_to_hub, to_storage_dtype, write_repo_folder
from .train_output import TrainOutput, read_summary, read_train_output

__all__ = ['FLOAT32_PARAM_NAMES', 'HubError', 'TrainOutput', 'create_model_from_hub', 'push_to_hub', 'read_summary',
           'read_train_output', 'to_storage_dtype', 'write_repo_folder']
