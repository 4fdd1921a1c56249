"""`make plan-check`: the plan held against the field's published GPU training runs (core/plan/published.py): one
line per run with its predicted and measured step and their ratio, the median and worst error over the validation
rows, the calibration rows apart and the refused rows with their reasons. Exits 1 when the median error passes 20%
or a row is off by more than 2x (issue 75's goals).

    python -m lab.plan_check              # make plan-check
    python -m lab.plan_check --calibrate  # solve gpu_efficiency.CALIBRATION from its named rows, to paste there
"""

import argparse
import sys

import fabric_gpt
from core.plan import published


def template():
    """A config of fabric_gpt.py's, whose shape and layout each row replaces (published.row_config)."""
    return fabric_gpt.resolve(fabric_gpt.Config(model="gpt2", cluster="h100-sxm", micro_batch_size=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m lab.plan_check")
    parser.add_argument("--calibrate", action="store_true", help="solve and print gpu_efficiency's calibrated numbers")
    args = parser.parse_args(argv)
    if args.calibrate:
        cal = published.calibrate(template())
        print(f"CALIBRATION = Calibration(host_op_s={cal.host_op_s * 1e6:.2f}e-6, devices=devices("
              + ", ".join(f"{k}=({cal.devices[k].gemm:.3f}, {cal.devices[k].attention:.3f})" for k in ("a100", "h100"))
              + "))")
        return 0
    result = published.check(template())
    published.print_check(result)
    s = result["summary"]
    return 0 if s["median"] <= published.GOAL_MEDIAN and s["worst"] <= published.GOAL_WORST else 1


if __name__ == "__main__":
    sys.exit(main())
