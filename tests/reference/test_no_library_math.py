"""The oracle's code calls no torch math kernel whose last bit is the library's choice.

torch's CPU sqrt, log2, exp, log, sin, cos, tanh, erf, ... run MKL VML (x86 MKL builds: kernel
picked by CPU vendor, not ATEN_CPU_CAPABILITY) or SLEEF (picked by ATEN_CPU_CAPABILITY), so their
bits differ between hosts; the H200 Xeon's torch.sqrt gave other tiny-v4 bits than an AMD EPYC's
(issue 13). The reference platform, hal/numerics.py and the model code it runs use the IEEE-built
`hal.numerics` versions instead. torch.sqrt's one allowed use is `numerics.sqrt64`'s first guess,
whose bits it corrects away."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIBRARY_MATH = {"sqrt", "rsqrt", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos",
                "tan", "tanh", "sinh", "cosh", "atan", "asin", "acos", "erf", "erfc", "erfinv", "sigmoid",
                "softmax", "log_softmax", "logsumexp", "pow", "float_power", "randn", "normal", "normal_",
                "silu", "gelu", "softplus", "logit", "lgamma", "digamma", "norm", "mean", "sum", "cumsum",
                "var", "std", "matmul", "mm", "bmm", "einsum", "baddbmm", "addmm", "linear"}
ALLOWED = {("hal/numerics.py", "sqrt64", "sqrt"),  # a first guess, corrected to the IEEE result
           ("hal/numerics.py", "scaled_matmul", "matmul"),  # exact integer sums (`dot_bits`)
           ("hal/numerics.py", "dot_pv", "matmul"),
           # counts of booleans: exact integers
           ("hal/numerics.py", "dot_pv", "sum"), ("platforms/reference/attention.py", "sparse_attention", "sum"),
           ("platforms/reference/sampling.py", "_keep_mask", "sum"),
           # the load-time bit checks' random inputs, and the compiled loop that repeats numerics' ops
           ("platforms/reference/native.py", "_edge_values", "randn"),
           ("platforms/reference/native.py", "_check_rowops", "randn"),
           ("platforms/reference/native.py", "_linear_check_rows", "randn"),
           # the compiled fixed-point linear (native.c's integer sums), checked at load against numerics
           ("platforms/reference/gemm.py", "fixed_linear", "linear"),
           # the attention check's inputs: both forms see the same ones, whatever their bits
           ("platforms/reference/native.py", "_attention_case", "randn"),
           ("platforms/reference/native.py", "_attention_case", "cumsum"),
           ("platforms/reference/native.py", "_check_attention", "randn"),
           ("platforms/reference/sampling.py", "log_softmax", "log_softmax"),
           # a 1-D float64 prefix sum: torch adds it serially, in index order (IEEE adds)
           ("platforms/reference/sampling.py", "_keep_mask", "cumsum")}
FILES = sorted([*(ROOT / "platforms" / "reference").glob("*.py"), ROOT / "hal" / "numerics.py",
                ROOT / "core" / "models" / "deepseek_v4.py", ROOT / "core" / "models" / "deepseek_v41.py"])


def library_math_calls(path: pathlib.Path) -> list[tuple[str, str, int]]:
    """(enclosing function, f, line, receiver) for calls torch.f(...), torch.nn.functional.f(...)
    or x.f(...) with f in LIBRARY_MATH, x any receiver but hal.numerics, the op table or math."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) \
                    and child.func.attr in LIBRARY_MATH:
                base = ast.unparse(child.func.value)
                # hal.numerics, the HAL op table (ops.linear, self.ops.rms_norm), Python's math
                if base not in ("numerics", "ops", "self.ops", "math"):
                    found.append((name, child.func.attr, child.lineno, base))
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_oracle_calls_no_library_math():
    bad = []
    for path in FILES:
        rel = path.relative_to(ROOT).as_posix()
        for func, attr, line, base in library_math_calls(path):
            if (rel, func, attr) not in ALLOWED:
                bad.append(f"{rel}:{line} {base}.{attr} in {func}")
    assert not bad, "library math in the oracle (use shuili.hal.numerics): " + "; ".join(bad)


def test_scan_finds_a_library_call(tmp_path):
    # negative control: the scanner sees torch.sqrt and a tensor's .exp()
    p = tmp_path / "m.py"
    p.write_text("import torch\ndef f(x):\n    return torch.sqrt(x) + x.exp()\n")
    assert [(f, a) for f, a, _, _ in library_math_calls(p)] == [("f", "sqrt"), ("f", "exp")]
