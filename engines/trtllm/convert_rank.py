"""Worker: convert one rank of a Hugging Face checkpoint into a TensorRT-LLM checkpoint.

Run as a subprocess by the convert stage (one process per rank frees the host memory between ranks
and gives each its own log), inside an environment where `tensorrt_llm` imports::

    python -m specbuild.engines.trtllm.convert_rank --model-class LLaMAForCausalLM \
        --model-dir HF_DIR --output-dir CKPT_DIR --dtype float16 --tp-size 2 --pp-size 1 --rank 0

This is the unified-API equivalent of `examples/models/core/llama/convert_checkpoint.py`:
`<ModelClass>.from_hugging_face(dir, dtype, mapping=Mapping(world_size, rank, tp_size, pp_size),
quant_config=...)` then `.save_checkpoint(out, save_config=(rank == 0))`. FP8 needs calibration over
the whole model and goes through `<ModelClass>.quantize(...)` once (`--calibrate`), which writes all ranks.
"""

from __future__ import annotations

import argparse
import sys

# --quantization -> tensorrt_llm.quantization.QuantAlgo member
QUANT_ALGOS = {"int8_wo": "W8A16", "int4_wo": "W4A16", "fp8": "FP8"}


def quant_config(quantization: str | None):
    from tensorrt_llm.models.modeling_utils import QuantConfig
    from tensorrt_llm.quantization import QuantAlgo
    if not quantization:
        return QuantConfig()
    algo = getattr(QuantAlgo, QUANT_ALGOS[quantization])
    if quantization == "fp8":
        return QuantConfig(quant_algo=algo, kv_cache_quant_algo=QuantAlgo.FP8)
    return QuantConfig(quant_algo=algo)


def convert_rank(model_class: str, model_dir: str, output_dir: str, dtype: str, tp: int, pp: int, rank: int,
                 quantization: str | None = None) -> None:
    import tensorrt_llm.models as models
    from tensorrt_llm import Mapping
    cls = getattr(models, model_class)
    mapping = Mapping(world_size=tp * pp, rank=rank, tp_size=tp, pp_size=pp)
    model = cls.from_hugging_face(model_dir, dtype, mapping=mapping, quant_config=quant_config(quantization))
    model.save_checkpoint(output_dir, save_config=(rank == 0))


def calibrate(model_class: str, model_dir: str, output_dir: str, dtype: str, tp: int, pp: int,
              quantization: str, calib_dataset: str) -> None:
    import tensorrt_llm.models as models
    from tensorrt_llm import Mapping
    cls = getattr(models, model_class)
    mapping = Mapping(world_size=tp * pp, tp_size=tp, pp_size=pp)
    cls.quantize(model_dir, output_dir, dtype=dtype, mapping=mapping, quant_config=quant_config(quantization),
                 calib_dataset=calib_dataset)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-class", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--dtype", required=True, choices=["float16", "bfloat16", "float32"])
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--pp-size", type=int, default=1)
    p.add_argument("--rank", type=int)
    p.add_argument("--quantization", choices=sorted(QUANT_ALGOS))
    p.add_argument("--calibrate", action="store_true", help="quantize with calibration (all ranks at once)")
    p.add_argument("--calib-dataset", default="cnn_dailymail")
    a = p.parse_args(argv)
    if a.calibrate:
        calibrate(a.model_class, a.model_dir, a.output_dir, a.dtype, a.tp_size, a.pp_size, a.quantization,
                  a.calib_dataset)
    else:
        if a.rank is None:
            p.error("--rank is required without --calibrate")
        convert_rank(a.model_class, a.model_dir, a.output_dir, a.dtype, a.tp_size, a.pp_size, a.rank,
                     a.quantization)
    return 0


if __name__ == "__main__":  # pragma: no cover - run as a subprocess
    sys.exit(main())
