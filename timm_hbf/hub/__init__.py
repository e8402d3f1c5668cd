"""Push train.py checkpoints to the Hugging Face Hub; ``timm.create_model('hf-hub:ORG/NAME', pretrained=True)`` loads
them back."""
from .push import FLOAT32_PARAM_NAMES, push_to_hub, to_storage_dtype, write_repo_folder
from .train_output import HubError, TrainOutput, read_summary, read_train_output

__all__ = ['FLOAT32_PARAM_NAMES', 'HubError', 'TrainOutput', 'push_to_hub', 'read_summary', 'read_train_output',
           'to_storage_dtype', 'write_repo_folder']
