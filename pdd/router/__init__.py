"""The PDD router (`python -m pdd.router`): fans a request out to P, RLD and MD, hands it off
from RLD to MD over the control plane, and stitches the two streams into one."""
