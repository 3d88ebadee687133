"""Shared parts of the foreign loops (tests/checks/test_foreign_loops.py): RL loops written in the styles of
trainers tracer did not write (OpenRLHF's PPO, DAPO, GRPO with gradient accumulation), each with its own
sampler, reward and loss, knowing nothing of tracer's demo loops. A tiny word-level tokenizer, a tiny
Qwen2 model briefly trained on a few sentences (so that its distributions are peaked like a real SFT
start), a plain sampling loop and a toy reward."""
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
import torch.nn as nn
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

torch.set_num_threads(1)

SENTENCES = [
    "the cat sat on the mat", "a dog ran in the park", "one plus one is two",
    "two plus two is four", "the sun is hot and bright", "birds fly over the sea",
    "what is three plus four", "seven is a number", "green apples are sour",
    "red roses smell sweet", "we like to eat bread", "rain falls on the roof",
]
PROMPTS = ["one plus one is", "the cat sat", "what is three plus four", "birds fly",
           "red roses", "we like to eat bread and"]


def build_tokenizer():
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tr = trainers.WordLevelTrainer(special_tokens=["<pad>", "<eos>", "<unk>"])
    tok.train_from_iterator(SENTENCES * 3, tr)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                 unk_token="<unk>")
    hf.padding_side = "left"
    return hf  # pad id 0, eos id 1


def build_model(vocab_size, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=64, vocab_size=vocab_size,
                      max_position_embeddings=128, tie_word_embeddings=False,
                      pad_token_id=0, eos_token_id=1, bos_token_id=1)
    m = Qwen2ForCausalLM(cfg)
    m.config._attn_implementation = "eager"
    return m


class Critic(nn.Module):
    """Separate critic: a Qwen2 backbone plus a scalar value head (OpenRLHF style)."""
    def __init__(self, vocab_size, seed=1):
        super().__init__()
        lm = build_model(vocab_size, seed)
        self.backbone = lm.model
        self.value_head = nn.Linear(32, 1)

    def forward(self, input_ids, attention_mask, position_ids):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids).last_hidden_state
        return self.value_head(h).squeeze(-1)


def encode_prompts(tok, prompts):
    enc = tok(prompts, return_tensors="pt", padding=True)  # left padded
    return enc["input_ids"], enc["attention_mask"]


@torch.no_grad()
def sample(model, prompt_ids, prompt_mask, max_new, temperature=1.0, eos=1, pad=0, gen=None):
    """Plain sampling loop (full forward each token). Returns completion ids (right-padded with
    pad after EOS), a float response mask (1 up to and including EOS), and the sampler's logprob of
    each sampled token (logits / temperature)."""
    B = prompt_ids.shape[0]
    ids = prompt_ids.clone()
    attn = prompt_mask.clone()
    done = torch.zeros(B, dtype=torch.bool)
    out, lps, masks = [], [], []
    for _ in range(max_new):
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1].float()
        logp = torch.log_softmax(logits / temperature, -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
        lp = logp.gather(-1, nxt[:, None]).squeeze(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        lp = torch.where(done, torch.zeros_like(lp), lp)
        masks.append((~done).long())
        out.append(nxt)
        lps.append(lp)
        done = done | (nxt == eos)
        ids = torch.cat([ids, nxt[:, None]], 1)
        attn = torch.cat([attn, masks[-1][:, None]], 1)
    return torch.stack(out, 1), torch.stack(masks, 1), torch.stack(lps, 1)


def token_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_attn, temperature=1.0):
    """log p of each completion token: logits[:, L-1:-1] for a left-padded prompt of width L."""
    L = prompt_ids.shape[1]
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attn = torch.cat([prompt_mask, completion_attn.long()], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    logits = logits[:, L - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None]).squeeze(-1)


def reward_fn(tok, completion_ids, mask):
    """Toy rule reward: +1 per distinct word 'two'/'four'/'the', minus length penalty, bonus for EOS."""
    rs = []
    for row, m in zip(completion_ids.tolist(), mask.tolist()):
        toks = [t for t, k in zip(row, m) if k]
        text = tok.decode(toks, skip_special_tokens=True).split()
        r = 0.5 * len({w for w in text if w in ("two", "four", "the", "sea")})
        r += 1.0 if 1 in toks else 0.0
        r -= 0.1 * len(toks)
        rs.append(r)
    return torch.tensor(rs)


def sft_model(tok, seed=0, steps=12, path=None):
    """A tiny model briefly trained on SENTENCES (and the prompts), so that its distributions are
    peaked like a real SFT start (cached on disk); FOREIGN_UNTRAINED=1 in the environment: untrained."""
    if os.environ.get("FOREIGN_UNTRAINED"):  # the model as built: near-uniform outputs (tokens repeat often)
        return build_model(len(tok), seed)
    path = path or os.path.join(os.environ.get("FOREIGN_CACHE", tempfile.gettempdir()), f"foreign_sft_{seed}.pt")
    m = build_model(len(tok), seed)
    if os.path.exists(path):
        m.load_state_dict(torch.load(path))
        return m
    tmp = f"{path}.{os.getpid()}.partial"  # two loops starting at once each write their own, then rename
    texts = [s + " <eos>" for s in SENTENCES]
    tok.padding_side = "right"
    enc = tok(texts, return_tensors="pt", padding=True)
    tok.padding_side = "left"
    ids, attn = enc["input_ids"], enc["attention_mask"]
    labels = ids.masked_fill(attn == 0, -100)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = m(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad(); loss.backward(); opt.step()
    torch.save(m.state_dict(), tmp)
    os.replace(tmp, path)
    return m
