"""Four small ports of real training programs on the public API, in one process job.

    python tests/api_scripts/real_programs.py --output-dir OUT
    torchrun --standalone --nproc-per-node 2 tests/api_scripts/real_programs.py --output-dir OUT
    mpirun -np 2 python tests/api_scripts/real_programs.py --output-dir OUT --backend torch

1. lm:     pytorch/examples word_language_model: an LSTM LM with its hidden state
           carried across batches (``model.init_hidden`` called on the prepared
           model), detached every batch, ``torch.nn.utils.clip_grad_norm_`` between
           backward and step.
2. gan:    pytorch/examples dcgan: generator and discriminator prepared
           separately, three backward passes per step (D on real, D on fake.detach(),
           then G through D), and a rank-0-only preview of the generator.
3. hf:     a Hugging Face style classifier: dict samples of variable length, a
           padding collate_fn, ``model(**batch)``, AdamW with a linear warm-up
           LambdaLR, 2 micro-batches per step (the first under ``job.no_sync``),
           ``job.clip_grad_norm_``; 1001 samples, not a multiple of the global batch.
4. branch: find_unused_parameters=True: a head used on even steps only (on every
           rank), and a parameter used on rank 0 only with a zero contribution to
           the loss (locally unused, globally used).

Everything is float64 on synthetic data drawn from fixed seeds (the same on every
rank); the global batch is fixed (divisible by 1, 2 and 3), so every world size
trains the same samples per step and must end with the same weights. Rank 0 writes
OUT/<program>.pt: the prepared model's ``state_dict()`` before and after training,
the world size, the backend and the largest difference between any rank's final
weights and rank 0's. A violated expectation raises (non-zero exit).
"""
import argparse
import os
import time
from typing import Dict, List

import torch
import torch.nn.functional as F
from program_tools import finish, per_rank_batch, plain_state
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, TensorDataset

import trainbridge as tb

torch.set_default_dtype(torch.float64)
GLOBAL_BATCH = 12  # divisible by 1, 2 and 3
PREVIEW_EVERY = 4  # GAN steps


# ----- 1. word language model -----------------------------------------------------------------
class RNNModel(nn.Module):
    """pytorch/examples word_language_model's RNNModel (LSTM), batch first."""

    def __init__(self, ntoken: int, ninp: int, nhid: int, nlayers: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ntoken, self.nhid, self.nlayers = ntoken, nhid, nlayers
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def markov_corpus(length: int, ntoken: int, seed: int) -> torch.Tensor:
    """Tokens from a fixed random Markov chain: something an LSTM can learn."""
    g = torch.Generator().manual_seed(seed)
    transitions = torch.softmax(3.0 * torch.randn(ntoken, ntoken, generator=g), dim=1)
    tokens = [0]
    for _ in range(length - 1):
        tokens.append(int(torch.multinomial(transitions[tokens[-1]], 1, generator=g)))
    return torch.tensor(tokens)


def word_language_model(job, out_dir: str) -> None:
    ntoken, bptt, nseq, epochs = 20, 10, 96, 3
    corpus = markov_corpus(nseq * bptt + 1, ntoken, seed=11)
    inputs = corpus[:-1].view(nseq, bptt)
    targets = corpus[1:].view(nseq, bptt)
    job.set_seed(100)  # per rank: ranks build different weights, prepare gives all rank 0's
    model = RNNModel(ntoken, ninp=16, nhid=24, nlayers=2, dropout=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=2.0)
    model, optimizer = job.prepare(model, optimizer)
    bsz = per_rank_batch(job, GLOBAL_BATCH)
    loader = job.train_loader(TensorDataset(inputs, targets), batch_size=bsz, seed=1)
    assert len(loader) == nseq // GLOBAL_BATCH, len(loader)

    # Attribute forwarding: the prepared model (a DDP wrapper under the torch backend) has the user's methods.
    initial = plain_state(model)
    assert initial.keys() == job.unwrap(model).state_dict().keys()
    wrapped = isinstance(model, DistributedDataParallel)
    job.print(f"lm: prepared model is {type(model).__name__} (a DDP wrapper: {wrapped}); init_hidden via the "
              f"prepared model, state_dict keys without 'module.'")

    criterion = nn.NLLLoss()
    losses: List[float] = []
    for _ in range(epochs):
        model.train()
        hidden = model.init_hidden(bsz)
        assert hidden[0].shape == (2, bsz, 24) and hidden[0].dtype == torch.float64
        for data, target in loader:
            assert data.shape == (bsz, bptt), data.shape
            hidden = repackage_hidden(hidden)
            model.zero_grad()
            output, hidden = model(data, hidden)
            loss = criterion(output, target.reshape(-1))
            job.backward(loss)
            # Plain torch clipping: the gradients are already averaged over the ranks.
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            job.step(optimizer)
            losses.append(job.allreduce(loss.detach(), "mean").item())
    job.print(f"lm: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps")
    finish(job, out_dir, "lm", initial, plain_state(model), losses=losses, prepared_is_ddp=wrapped,
           prepared_type=type(model).__name__)


# ----- 2. DCGAN ---------------------------------------------------------------------------------
NZ = 4


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(NZ, 32), nn.ReLU(True), nn.Linear(32, 32), nn.ReLU(True), nn.Linear(32, 2))

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 32),
                                  nn.LeakyReLU(0.2, inplace=True), nn.Linear(32, 1), nn.Sigmoid())

    def forward(self, input):
        return self.main(input)


def ring_of_gaussians(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    angles = torch.randint(0, 8, (n,), generator=g) * (2 * torch.pi / 8)
    centers = torch.stack([torch.cos(angles), torch.sin(angles)], dim=1) * 2.0
    return centers + 0.05 * torch.randn(n, 2, generator=g)


def dcgan(job, out_dir: str) -> None:
    epochs = 3
    data = ring_of_gaussians(240, seed=12)
    job.set_seed(200)
    netG, netD = Generator(), Discriminator()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999))
    netG, optimizerG = job.prepare(netG, optimizerG)
    netD, optimizerD = job.prepare(netD, optimizerD)
    initial = {**plain_state(netG, "G."), **plain_state(netD, "D.")}
    bsz = per_rank_batch(job, GLOBAL_BATCH)
    loader = job.train_loader(TensorDataset(data), batch_size=bsz, seed=2)
    criterion = nn.BCELoss()
    fixed_noise = torch.randn(16, NZ, generator=torch.Generator().manual_seed(99)).to(job.device)
    real_label, fake_label = 1.0, 0.0
    step, previews, history = 0, [], []
    for _epoch in range(epochs):
        for (real,) in loader:
            # Noise per sample of the global batch, the same on every world size: this rank takes its rows
            # by the loader's stride (rank, rank + world_size, ...).
            global_noise = torch.randn(GLOBAL_BATCH, NZ, generator=torch.Generator().manual_seed(1000 + step))
            noise = global_noise[job.rank::job.world_size].to(job.device)
            ############################
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            ###########################
            netD.zero_grad()
            label = torch.full((bsz,), real_label, device=job.device)
            output = netD(real).view(-1)
            errD_real = criterion(output, label)
            job.backward(errD_real)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach()).view(-1)
            errD_fake = criterion(output, label)
            job.backward(errD_fake)
            errD = errD_real + errD_fake
            job.step(optimizerD)
            ############################
            # (2) Update G network: maximize log(D(G(z)))
            ###########################
            netG.zero_grad()
            label.fill_(real_label)  # fake labels are real for generator cost
            output = netD(fake).view(-1)
            errG = criterion(output, label)
            job.backward(errG)
            job.step(optimizerG)
            step += 1
            history.append((errD.item(), errG.item()))
            if job.is_main and step % PREVIEW_EVERY == 0:
                # dcgan's vutils.save_image(netG(fixed_noise)) on the main rank only: must neither hang nor
                # disturb the next step's gradient averaging.
                with torch.no_grad():
                    preview = job.unwrap(netG)(fixed_noise)
                torch.save(preview.cpu(), os.path.join(out_dir, f"gan_preview_rank{job.rank}_step{step}.pt"))
                previews.append(step)
                print(f"gan: preview at step {step} on rank {job.rank}", flush=True)
    job.print(f"gan: Loss_D {history[0][0]:.4f} -> {history[-1][0]:.4f}, Loss_G {history[0][1]:.4f} -> "
              f"{history[-1][1]:.4f} in {step} steps")
    final = {**plain_state(netG, "G."), **plain_state(netD, "D.")}
    finish(job, out_dir, "gan", initial, final, previews=previews, steps=step)


# ----- 3. Hugging Face style text classifier --------------------------------------------------------
class VariableLengthTexts(Dataset):
    """Dict samples of 3 to 15 tokens; the label: whether low tokens outnumber high ones."""

    def __init__(self, n: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, 16, (n,), generator=g).tolist()
        self.texts = [torch.randint(1, vocab, (length,), generator=g) for length in lengths]
        self.labels = [int((t < vocab // 2).sum() * 2 > len(t)) for t in self.texts]

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        ids = self.texts[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor(self.labels[i])}


def pad_collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """DataCollatorWithPadding: pad input_ids with 0 and attention_mask with 0 to the batch's longest."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, :len(s["input_ids"])] = s["input_ids"]
        mask[row, :len(s["attention_mask"])] = s["attention_mask"]
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.stack([s["labels"] for s in samples])}


class TinyClassifier(nn.Module):
    def __init__(self, vocab: int, dim: int, num_labels: int) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim, padding_idx=0)
        self.classifier = nn.Linear(dim, num_labels)

    def forward(self, input_ids, attention_mask, labels=None):
        hidden = self.embeddings(input_ids)
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        logits = self.classifier(torch.tanh(pooled))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def hf_classifier(job, out_dir: str) -> None:
    vocab, epochs, accumulation, warmup = 30, 2, 2, 5
    dataset = VariableLengthTexts(1001, vocab, seed=13)  # 1001 = 41 global batches of 24 and 17 left over
    job.set_seed(300)
    model = TinyClassifier(vocab, dim=16, num_labels=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.01)
    model, optimizer = job.prepare(model, optimizer)  # a scheduler comes after prepare
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    initial = plain_state(model)
    micro_global = 2 * GLOBAL_BATCH
    loader = job.train_loader(dataset, batch_size=per_rank_batch(job, micro_global), seed=3,
                              collate_fn=pad_collate, num_workers=1)
    assert len(loader) == len(dataset) // micro_global == 41, len(loader)
    norms, lrs, updates = [], [], 0
    for _epoch in range(epochs):
        model.train()
        seen = 0
        for i, batch in enumerate(loader):
            assert set(batch) == {"input_ids", "attention_mask", "labels"}, batch.keys()
            seen += 1
            last = i + 1 == len(loader)
            accumulate = (i + 1) % accumulation != 0 and not last  # Trainer: the epoch's last batch steps
            with job.no_sync(model, enabled=accumulate):
                outputs = model(**batch)
                loss = outputs["loss"] / accumulation
                job.backward(loss)
            if accumulate:
                continue
            norms.append(job.clip_grad_norm_(model, 1.0).item())
            job.step(optimizer)
            scheduler.step()
            optimizer.zero_grad()
            lrs.append(scheduler.get_last_lr()[0])
            updates += 1
        assert seen == len(loader) == 41, (seen, len(loader))
    assert updates == epochs * 21, updates
    job.print(f"hf: {updates} optimizer steps; grad norm {norms[0]:.4f} -> {norms[-1]:.4f}; lr {lrs[-1]:.3g}")
    finish(job, out_dir, "hf", initial, plain_state(model), norms=norms, lrs=lrs)


# ----- 4. unused parameters ---------------------------------------------------------------------
class BranchyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)
        self.aux_head = nn.Linear(16, 3)  # used on even steps only, on every rank
        self.extra = nn.Linear(8, 4)  # used on rank 0 only, contributing zero to the loss

    def forward(self, x, use_aux: bool, use_extra: bool):
        h = torch.tanh(self.trunk(x))
        out = self.head(h)
        if use_aux:
            out = out + 0.5 * self.aux_head(h)
        if use_extra:
            out = out + 0.0 * self.extra(x).sum()
        return out


def unused_branches(job, out_dir: str) -> None:
    epochs = 3
    g = torch.Generator().manual_seed(14)
    x = torch.randn(120, 8, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    job.set_seed(400)
    model = BranchyNet()
    # Adam with weight decay skips parameters whose gradient is None: aux_head on odd steps must stay untouched,
    # and extra must get a zero gradient (so decay) on every rank.
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.05)
    model, optimizer = job.prepare(model, optimizer, find_unused_parameters=True)
    initial = plain_state(model)
    loader = job.train_loader(TensorDataset(x, y), batch_size=per_rank_batch(job, GLOBAL_BATCH), seed=4)
    step = 0
    aux_grad_none = []  # per step: aux_head's gradient after backward is None (no rank used it)
    for _epoch in range(epochs):
        for xb, yb in loader:
            optimizer.zero_grad()  # set_to_none
            use_aux = step % 2 == 0  # a function of the step: the same on every rank and world size
            loss = F.cross_entropy(model(xb, use_aux=use_aux, use_extra=job.rank == 0), yb)
            job.backward(loss)
            unwrapped = job.unwrap(model)
            assert unwrapped.extra.weight.grad is not None and not unwrapped.extra.weight.grad.any(), \
                f"rank {job.rank} step {step}: extra's gradient should be zeros, got {unwrapped.extra.weight.grad}"
            aux_grad_none.append(unwrapped.aux_head.weight.grad is None)
            job.step(optimizer)
            step += 1
    job.print(f"branch: {step} steps; aux_head unused on {sum(aux_grad_none)} of them")
    finish(job, out_dir, "branch", initial, plain_state(model), aux_grad_none=aux_grad_none)


PROGRAMS = {"lm": word_language_model, "gan": dcgan, "hf": hf_classifier, "branch": unused_branches}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--programs", default=",".join(PROGRAMS), help="comma-separated subset, in this order")
    args = parser.parse_args()
    job = tb.init(backend=args.backend, timeout=90)
    job.print(f"real programs: backend {job.backend_name}, world size {job.world_size}")
    for name in args.programs.split(","):
        started = time.monotonic()
        PROGRAMS[name](job, args.output_dir)
        job.print(f"{name}: {time.monotonic() - started:.2f}s")
    job.exit(0)
