"""The runtime never imports the compiler (IR, passes, frontend, codegen), the reference model, or TVM."""

import subprocess
import sys


def test_runtime_imports_no_compiler_module():
    code = ("import sys, k3c, k3c.runtime.session, k3c.runtime.launchers.tvm, k3c.runtime.launchers.tvm_cuda\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('k3c.ir', 'k3c.passes', 'k3c.frontend', "
            "'k3c.codegen', 'k3c.compile', 'models', 'tvm', 'sympy', 'networkx')))\n"
            "print(','.join(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == ""
