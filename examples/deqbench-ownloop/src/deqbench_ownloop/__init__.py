# deqbench adapter of ownloop_net.ImplicitConvNet (written with no deqbench import, unedited).
#
# Two models from one network:
#
# * ``ownloop_conv``: the network as it is, its own damped Picard loop and its own Jacobian-free
#   backward; deqbench measures the loop (``OwnLoop``: f-evaluations, residual traces, converged)
#   and judges its solves like its own;
# * ``ownloop_conv_native``: the same map solved by deqbench (``cell_from_method``): every
#   deqbench solver and backward mode applies, e.g. Anderson with the implicit-function backward.


from ownloop_net import ImplicitConvNet
from torch import nn

from deqbench.adapters import OwnLoop, cell_from_method
from deqbench.deq import DEQLayer, DEQModel
from deqbench.models import declare_defaults


@declare_defaults(own_solver="picard", own_backward="jfb", init="default")
def ownloop_conv(in_shape=(1, 8, 8), num_outputs=10, channels=16, max_iter=40, tol=1e-3):
    net = ImplicitConvNet(in_shape[0], channels, num_outputs, max_iter=max_iter, tol=tol)
    return OwnLoop(net, map="block", loop="find_fixed_point", tol="tol", max_iter="max_iter",
                   solver_name="picard", backward_name="jfb")  # fmt: skip


class Native(DEQModel):
    # stem -> DEQLayer(the network's block) -> head
    def __init__(self, net: ImplicitConvNet) -> None:
        super().__init__()
        self.net = net
        self.deq = DEQLayer(cell_from_method(net, "block"))

    def inject(self, x):
        return self.net.stem(x)

    def readout(self, z):
        return self.net.head(z)


@declare_defaults(solver={"name": "anderson", "max_iter": 40, "tol": 1e-3},
                  backward={"name": "ift", "solver": "anderson", "max_iter": 40, "tol": 1e-4})  # fmt: skip
def ownloop_conv_native(in_shape=(1, 8, 8), num_outputs=10, channels=16) -> nn.Module:
    return Native(ImplicitConvNet(in_shape[0], channels, num_outputs))
