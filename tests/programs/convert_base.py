"""Convert a tiny Hugging Face model to a GGUF base model with llama.cpp's own converter (a checkout's
convert_hf_to_gguf and conversion package, at LLAMA_CPP_DIR): the reference the adapter export must match.

    python convert_base.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf

The tests' tokenizers are made locally, so the converter cannot recognise their pre-tokenizer by its hash;
the comparison feeds token ids, so the vocabulary is written as plain GPT-2 BPE and the check is skipped.
"""

import sys
from pathlib import Path

root, model_dir, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
sys.path[:0] = [str(root), str(root / "gguf-py")]  # the converter's own gguf-py, as it runs itself

import gguf  # noqa: E402
import torch  # noqa: E402
from conversion import ModelBase, ModelType, get_model_architecture, get_model_class  # noqa: E402

hparams = ModelBase.load_hparams(model_dir, False)
reference = get_model_class(get_model_architecture(hparams, ModelType.TEXT))


class TinyVocab(reference):
    model_arch = reference.model_arch

    def get_vocab_base_pre(self, tokenizer) -> str:
        return "gpt-2"

    def set_vocab(self) -> None:
        self._set_vocab_gpt2()


with torch.inference_mode():
    TinyVocab(model_dir, gguf.LlamaFileType.ALL_F32, out, eager=True).write()
print(out)
