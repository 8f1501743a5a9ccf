"""The GEMMs of a compiled XLA program, read from its optimized HLO text.

Only after optimization does XLA decide what each matmul runs as: a `dot` (a CPU's own loop),
a `triton gemm` (a dot inside a GPU's Triton GEMM fusion), or a library call (`custom-call`
to cuBLAS: `__cublas$gemm`, `__cublas$lt$matmul`, and `__cublas$lt$matmul$f8` for float8
operands). Each keeps the
`op_name` of the framework op it came from, with the name scopes it ran in (JAX:
`jit(train_step)/transpose(jvp(model))/dense/dot_general`; TensorFlow:
`gradient_tape/model_1/dense_1/MatMul`). A GEMM runs in float8 only where its operands
reach it as float8; a dot whose operands XLA converted first runs in the wider type.
"""

from __future__ import annotations

import dataclasses
import math
import re

# HLO element types and the names the census gives them.
_PRECISIONS = {
    "f8e4m3fn": "float8",
    "f8e5m2": "float8",
    "f8e4m3": "float8",
    "f8e4m3fnuz": "float8",
    "f8e5m2fnuz": "float8",
    "bf16": "bfloat16",
    "f16": "float16",
    "f32": "float32",
    "f64": "float64",
}
# `%name = TYPE op(` (TYPE may be a tuple: a cuBLAS call returns its workspace too).
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>\(.*?\)|\S+)\s+"
    r"(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)(?P<attributes>.*)$"
)
# A computation's header: `%fused_computation.2 (param_0: f32[32,4], ...) -> f32[32,32] {`.
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\((?P<params>.*)\)\s*->.*\{\s*$")
_HEADER_PARAM = re.compile(r"(?P<name>[\w.\-]+):\s*(?P<type>[a-z][a-z0-9]*)\[")
_ARRAY = re.compile(r"(?P<element>[a-z][a-z0-9]*)\[(?P<dims>[\d,]*)\]")
_OP_NAME = re.compile(r'op_name="(?P<op_name>[^"]*)"')
_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]*)"')
_GRAD = re.compile(r'grad_(?P<which>[xy])="true"')
# Library calls that are GEMMs (cuBLAS, cuBLASLt, hipBLASLt; oneDNN's matmul on CPUs).
_GEMM_TARGET = re.compile(r"gemm|matmul", re.IGNORECASE)
# A fusion XLA hands to Triton as a GEMM (`__triton_gemm`, `__triton_nested_gemm_fusion`):
# `calls=%gemm_fusion_dot.3_computation, ...`.
_TRITON_GEMM_CALL = re.compile(
    r'calls=%?(?P<computation>[\w.\-]+).*"kind":"__triton[a-z_]*gemm[a-z_]*"'
)
TRITON_GEMM = "triton gemm"


@dataclasses.dataclass(frozen=True)
class CompiledGemm:
    """One GEMM of a compiled program.

    `kernel`: `dot`, `triton gemm`, or the library call's target. `operand_types`: the HLO
    element types of its operands as they reach it (`f8e4m3fn`, `bf16`, ...). `op_name`: the
    framework op it came from, with its name scopes. `gradient_of`: `x` or `y` where
    TensorFlow says the GEMM computes the gradient of its op's first or second operand
    (`grad_x`/`grad_y`), else None.
    """

    name: str
    kernel: str
    operand_types: tuple[str, ...]
    result_shape: tuple[int, ...]
    op_name: str
    gradient_of: str | None = None

    @property
    def precision(self) -> str:
        """What it multiplies in: `float8` if every operand is float8 (or the call is a float8
        one), else the widest operand's type (`bfloat16`, `float16`, `float32`)."""
        if self.kernel.endswith("$f8"):
            return "float8"
        names = [_PRECISIONS.get(element, element) for element in self.operand_types[:2]]
        if names and all(name == "float8" for name in names):
            return "float8"
        ranked = ("float64", "float32", "float16", "bfloat16")
        for name in ranked:
            if name in names:
                return name
        return names[0] if names else "unknown"

    @property
    def result_size(self) -> int:
        return math.prod(self.result_shape)


def compiled_gemms(hlo: str) -> tuple[CompiledGemm, ...]:
    """Every GEMM of an optimized HLO module's text (`dot`s and GEMM library calls), in order."""
    gemms: list[CompiledGemm] = []
    triton = {match["computation"] for match in _TRITON_GEMM_CALL.finditer(hlo)}
    types: dict[str, str] = {}  # The current computation's values: name -> element type.
    in_triton = False
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            types = {
                param["name"]: param["type"] for param in _HEADER_PARAM.finditer(header["params"])
            }
            in_triton = header["name"] in triton
            continue
        instruction = _INSTRUCTION.match(line)
        if not instruction:
            continue
        array = _ARRAY.search(instruction["type"])
        if array:
            types[instruction["name"]] = array["element"]
        gemm = _gemm(instruction, array, types, in_triton)
        if gemm is not None:
            gemms.append(gemm)
    return tuple(gemms)


def _gemm(
    instruction: re.Match, array: re.Match | None, types: dict[str, str], in_triton: bool
) -> CompiledGemm | None:
    attributes = instruction["attributes"]
    if instruction["op"] == "dot":
        kernel = TRITON_GEMM if in_triton else "dot"
    elif instruction["op"] == "custom-call":
        target = _TARGET.search(attributes)
        if target is None or not _GEMM_TARGET.search(target["target"]):
            return None
        kernel = target["target"]
    else:
        return None
    operand_types = []
    for operand in _top_level_items(instruction["operands"]):
        inline = _ARRAY.match(operand)  # The long form: `f32[4,8]{1,0} %x`.
        name = operand.split()[-1].lstrip("%")
        operand_types.append(inline["element"] if inline else types.get(name, "unknown"))
    op_name = _OP_NAME.search(attributes)
    gradient = _GRAD.search(attributes)
    dims = array["dims"] if array else ""
    return CompiledGemm(
        name=instruction["name"],
        kernel=kernel,
        operand_types=tuple(operand_types),
        result_shape=tuple(int(d) for d in dims.split(",") if d),
        op_name=op_name["op_name"] if op_name else "",
        gradient_of=gradient["which"] if gradient else None,
    )


def _top_level_items(text: str) -> list[str]:
    """`text` split at commas outside brackets and braces (`f32[8,8]{1,0} %x, %y`)."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]
