# deqbench adapter of DeepInverse's deep equilibrium PnP-PGD (deepinv 0.5.0, unedited).
#
# * ``deepinv_pgd``: deepinv's DEQ as it is: its own fixed-point loop (plain or Anderson) and
#   its own backward (implicit, solving w = J^T w + g with a gradient hook, or Jacobian-free);
#   deqbench measures both (OwnLoop, OwnBackward) and judges them like its own solves;
# * ``deepinv_pgd_map``: the same PGD step (data step, then the DnCNN prior) as a deqbench cell,
#   solved by deqbench's solvers and backward modes.
# The denoiser is a small DnCNN with random weights (nothing is downloaded).

import deepinv as dinv
from torch import nn

from deqbench.adapters import OwnBackward, OwnLoop, cell_from_method
from deqbench.deq import DEQLayer, DEQModel
from deqbench.models import declare_defaults


class PGDNet(nn.Module):
    # deepinv's DEQ PnP-PGD for denoising (A = I): x -> argmin_x ||x - y||^2 / 2 + prior
    def __init__(self, channels, sigma, stepsize, max_iter, tol, anderson, jfb, depth, nf):
        super().__init__()
        self.physics = dinv.physics.Denoising(dinv.physics.GaussianNoise(sigma=sigma))
        denoiser = dinv.models.DnCNN(channels, channels, depth=depth, nf=nf, pretrained=None)
        self.pgd = dinv.optim.PGD(
            prior=dinv.optim.PnP(denoiser=denoiser), data_fidelity=dinv.optim.L2(),
            stepsize=stepsize, sigma_denoiser=sigma, max_iter=max_iter, thres_conv=tol,
            early_stop=True, anderson_acceleration=anderson,
            DEQ=dinv.optim.DEQConfig(jacobian_free=jfb, max_iter_backward=max_iter))  # fmt: skip

    def forward(self, y):
        return self.pgd(y, self.physics)

    def step(self, x, y):  # the map F(x, y): one PGD iteration, as deepinv's loop applies it
        p = self.pgd
        X = {"est": (x,)}
        return p.fixed_point.iterator(X, p.data_fidelity[0], p.prior[0], p.update_params_fn(0),
                                      y, self.physics)["est"][0]  # fmt: skip


def _net(in_shape, sigma=0.1, stepsize=0.5, max_iter=60, tol=1e-4, loop="plain",
         backward="ift", depth=4, nf=8):  # fmt: skip
    return PGDNet(in_shape[0], sigma, stepsize, max_iter, tol, loop == "anderson",
                  backward == "jfb", depth, nf)  # fmt: skip


@declare_defaults(own_solver="{loop}", own_backward="{backward}", init="default")
def deepinv_pgd(in_shape=(1, 14, 14), num_outputs=196, loop="plain", backward="ift", **params):
    net = _net(in_shape, loop=loop, backward=backward, **params)
    return OwnLoop(net, map="pgd.fixed_point.iterator", loop="pgd.fixed_point", state="est.0",
                   returned="0", tol="pgd.thres_conv", max_iter="pgd.max_iter",
                   stop="batch_mean", solver_name=loop, backward_name=backward,
                   adjoint=OwnBackward(tol="pgd.thres_conv", stop="batch_mean",
                                       max_iter="pgd.DEQ_config.max_iter_backward"))  # fmt: skip


class PGDMap(DEQModel):
    # the noisy image is the injection; the equilibrium is the restored image
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.deq = DEQLayer(cell_from_method(net, "step", uses=["pgd.prior", "pgd.params_algo"]))

    def inject(self, y):
        return y

    def readout(self, x):
        return x


@declare_defaults(solver={"name": "anderson", "max_iter": 60, "tol": 1e-4},
                  backward={"name": "ift", "solver": "anderson", "max_iter": 60, "tol": 1e-4})  # fmt: skip
def deepinv_pgd_map(in_shape=(1, 14, 14), num_outputs=196, **params):
    return PGDMap(_net(in_shape, **params))
