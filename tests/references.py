"""Plain-PyTorch reference implementations, one tensor at a time, for the optimizers
torch.optim lacks (LAMB, LARS, Lion) and for Adam without bias correction, and of the
delayed parameter update for Lightning runs.  Written from the algorithms' definitions,
independently of lightning_fastopt."""

import math

import lightning as L
import torch


def lion_step(p, g, m, *, lr, beta1, beta2, weight_decay, maximize=False):
    """Returns a mask of the elements whose update direction is ambiguous: the
    interpolation is within 4 float32 ulps of zero, so its sign depends on rounding."""
    g = -g if maximize else g
    p.mul_(1 - lr * weight_decay)
    c = m.lerp(g, 1 - beta1)
    ambiguous = c.abs() <= 4 * torch.finfo(torch.float32).eps * (m.abs() + g.abs())
    p.add_(torch.sign(c), alpha=-lr)
    m.lerp_(g, 1 - beta2)
    return ambiguous


def lars_step(p, g, buf, *, lr, momentum, eeta, weight_decay, epsilon, maximize=False):
    g = -g if maximize else g
    pn = p.double().norm().item()
    gn = g.double().norm().item()
    local = eeta * pn / (gn + weight_decay * pn + epsilon) if pn > 0 and gn > 0 else 1.0
    buf.mul_(momentum).add_(g + weight_decay * p)
    p.add_(buf, alpha=-lr * local)


def lamb_step(params, grads, ms, vs, *, step, lr, beta1, beta2, eps, weight_decay, bias_correction=True,
              adam_w_mode=True, grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False, maximize=False):
    """One LAMB step over all tensors of a group (apex FusedLAMB semantics)."""
    grads = [-g if maximize else g for g in grads]
    norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads))
    divisor = norm / max_grad_norm if max_grad_norm > 0 and norm > max_grad_norm else 1.0
    beta3 = 1 - beta1 if grad_averaging else 1.0
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    for p, g, m, v in zip(params, grads, ms, vs):
        g = g / divisor
        if not adam_w_mode and weight_decay != 0:
            g = g + weight_decay * p
        m.mul_(beta1).add_(g, alpha=beta3)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        u = (m / bc1) / ((v / bc2).sqrt() + eps)
        if adam_w_mode and weight_decay != 0:
            u = u + weight_decay * p
        pn, un = p.double().norm().item(), u.double().norm().item()
        ratio = pn / un if (weight_decay != 0 or use_nvlamb) and pn > 0 and un > 0 else 1.0
        p.add_(u, alpha=-lr * ratio)


def adam_step(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction=True,
              maximize=False, vmax=None):
    """Adam/AdamW as torch.optim.Adam computes it, with optional bias correction."""
    g = -g if maximize else g
    if weight_decay:
        if adamw:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    second = v
    if vmax is not None:
        torch.maximum(vmax, v, out=vmax)
        second = vmax
    denom = second.sqrt() / math.sqrt(bc2) + eps
    p.addcdiv_(m, denom, value=-lr / bc1)


class DelayedTorchUpdate(L.Callback):
    """``Trainer()`` with torch's update delayed as the strategy delays it: torch.optim
    steps the float32 masters (kept here); once ``warmup`` steps are done the model keeps
    the masters of before the last update, and gets the last one when training ends."""

    def __init__(self, warmup, delayed=None, sync_at_epoch_end=False):
        self.warmup = warmup
        self.delayed = delayed  # which parameters the delay applies to (default: all)
        # the model gets the masters at each epoch's end, before ModelCheckpoint saves there (as a
        # checkpoint of FastOptFSDPStrategy holds the pending update applied)
        self.sync_at_epoch_end = sync_at_epoch_end

    @torch.no_grad()
    def on_train_epoch_end(self, trainer, pl_module):
        if self.sync_at_epoch_end:
            for p, m in zip(pl_module.parameters(), self.masters):
                p.copy_(m)

    def on_train_start(self, trainer, pl_module):
        self.masters = [p.detach().clone() for p in pl_module.parameters()]
        self.steps = trainer.global_step

    @torch.no_grad()
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before = [m.clone() for m in self.masters]
        for p, m in zip(pl_module.parameters(), self.masters):
            p.copy_(m)  # torch steps the masters, with the gradients of the weights the model had

    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.steps:
            return  # accumulating: no step in this batch
        self.steps = trainer.global_step
        self.masters = [p.detach().clone() for p in pl_module.parameters()]
        if self.steps - 1 >= self.warmup:
            for p, b, d in zip(pl_module.parameters(), self.before, self.delayed or [True] * len(self.before)):
                if d:
                    p.copy_(b)

    @torch.no_grad()
    def on_train_end(self, trainer, pl_module):
        for p, m in zip(pl_module.parameters(), self.masters):
            p.copy_(m)


class _UserStep(torch.optim.Optimizer):
    """A user's optimizer in torch: the closure evaluated (as torch's steps do), then the
    subclass's ``update()`` of every parameter."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.update()
        return loss


class WholeTensorNorms(_UserStep):
    """A user's optimizer whose step reads norms over whole parameters (LARS's rule, in
    torch): under ``ModelParallelStrategy`` its step sees DTensors, whose norms span the
    ranks."""

    def update(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["step"] = state.get("step", torch.tensor(0.0)) + 1
                    ratio = p.norm() / (p.grad.norm() + 1e-3)
                    p.sub_(p.grad * ratio * group["lr"])


class GlobalNorm(_UserStep):
    """Every update scaled by the norm of all gradients (timm's Lamb clips that way): run once
    per share of the parameters, each share's norm would be another (docs/compatibility.md (n))."""

    def update(self):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad / (total + 1e-6) * group["lr"])
