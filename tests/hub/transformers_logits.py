"""Run by the transformers test in a fresh process, as a transformers user would, importing neither timm nor
timm_hbf: for each REPO, ``AutoImageProcessor`` and ``AutoModelForImageClassification.from_pretrained(REPO)``, their
logits on the IMAGES, and ``pipeline('image-classification', model=REPO)`` on them; saved to OUT, one entry per
repo (its error, if it raised).

    python transformers_logits.py OUT IMAGES REPO [REPO ...]

IMAGES is a file listing image paths, one per line.
"""
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, List

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageClassification, pipeline


def client_results(repo: str, images: List[Image.Image]) -> Dict[str, Any]:
    processor = AutoImageProcessor.from_pretrained(repo)
    model = AutoModelForImageClassification.from_pretrained(repo).eval()
    with torch.no_grad():
        logits = model(**processor(images, return_tensors='pt')).logits
    top1 = [predictions[0] for predictions in pipeline('image-classification', model=repo)(images, top_k=1)]
    return {
        'model_class': type(model).__name__,
        'processor_class': type(processor).__name__,
        'id2label': dict(model.config.id2label),
        'logits': logits,
        'pipeline_labels': [p['label'] for p in top1],
        'pipeline_scores': torch.tensor([p['score'] for p in top1]),
    }


def main(out: str, image_list: str, *repos: str) -> None:
    torch.set_num_threads(1)  # the same reduction order as the reference logits
    images = [Image.open(path).convert('RGB') for path in Path(image_list).read_text().split()]
    results = {}
    for repo in repos:
        try:
            results[repo] = client_results(repo, images)
        except Exception:
            results[repo] = {'error': traceback.format_exc()}
    results['registered_by_the_hook'] = 'timm_hbf' in sys.modules  # no import of it here: the .pth hook did it
    torch.save(results, out)


if __name__ == '__main__':
    main(*sys.argv[1:])
