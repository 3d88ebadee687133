"""Agentic RL written the way MiniMind's trainer/train_agent.py is: multi-turn rollouts with tool calls,
each episode packed into one row (prompt, assistant turns, tool results), CISPO (its default) or GRPO.
`rollout_single`, `rollout_batch`, `calculate_rewards` and `rl_train_epoch` are MiniMind's, with its
variable names and its packing and masking code: `input_ids` is [B, L]; the per-token tensors
(`per_token_logps`, `old_per_token_logps`, `ref_per_token_logps`, `completion_mask =
full_response_masks[:, 1:]`) are [B, L-1], position t scoring token t+1; old logprobs are 0.0 at prompt
and tool-result positions; the model's EOS tokens are dropped from the trained tokens. It knows nothing
of tracer: tests trace it with `python -m tracer run --algo cispo ... -- minimind_agent.py`.

What differs from MiniMind, and why:

- The model is the tiny local one (`python -m tracer demo` writes it; `--model_dir`), with `<|im_start|>`
  and `<|im_end|>` added as special tokens (MiniMind's tokenizer has them) and a ChatML template with
  system / user / assistant / tool roles; its EOS stays `<|endoftext|>`, which it learnt to end with.
- `ScriptedRolloutEngine` stands for MiniMind's `TorchRolloutEngine` (trainer/rollout_engine.py): same
  `.rollout(...)` and `RolloutResult`, sampling at the given temperature and scoring the returned tokens
  with `compute_per_token_logps` (raw logits, as MiniMind's engine does). It forces a
  `<tool_call>{"name": "calculate_math", ...}</tool_call>` answer on the first turn of some episodes
  (and on the second of a few), since the tiny model never calls a tool; the logprobs of those tokens are
  still the model's. It returns the canonical tokens of the text it produced (the tokens the trainer's
  re-tokenised chat gets), so a healthy run has no token drift between rollout and training.
- No reward model, checkpointing, DDP, wandb or SkipBatchSampler; tools are MiniMind's calculate_math only,
  run without the SIGALRM timeout (the watcher's tests may own that signal).
- `--inject BUG` injects a known agentic bug for the checks' tests (none by default).
- `--dump_dir DIR` saves each step's tensors (safetensors, before backward) for the tests to compare with.
"""

import argparse
import json
import math
import os
import random
import re
from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, optim
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import CosineAnnealingLR
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {% for tool in tools %}{{ tool['function']['name'] }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_CALL = '<tool_call>{{"name": "calculate_math", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


INJECT = ""  # --inject: a known bug, for tests (set in __main__)


def Logger(content):
    print(content)


def is_main_process():
    return True


def setup_seed(seed):
    random.seed(seed)
    torch.manual_seed(seed)


# ===== trainer/rollout_engine.py =====
def compute_per_token_logps(model, input_ids: Tensor, n_keep: int, attention_mask: Optional[Tensor] = None) -> Tensor:
    if n_keep <= 0:
        return input_ids.new_empty((input_ids.size(0), 0), dtype=torch.float32)
    unwrapped = model.module if isinstance(model, DistributedDataParallel) else model
    input_ids = input_ids.detach().clone() if input_ids.is_inference() else input_ids
    logits = unwrapped(input_ids, attention_mask=attention_mask, logits_to_keep=n_keep + 1).logits[:, :-1, :]
    per_token_logps = []
    for logits_row, ids_row in zip(logits, input_ids[:, -n_keep:]):
        ids_row = ids_row.detach().clone() if ids_row.is_inference() else ids_row
        per_token_logps.append(
            torch.gather(logits_row.log_softmax(dim=-1), 1, ids_row.unsqueeze(1)).squeeze(1)
        )
    return torch.stack(per_token_logps)


@dataclass
class RolloutResult:
    output_ids: Tensor
    completion_ids: Tensor
    per_token_logps: Tensor
    completions: List[str]
    prompt_lens: Tensor
    completion_mask: Tensor


class ScriptedRolloutEngine:
    """MiniMind's TorchRolloutEngine with scripted tool calls: at the first turn of an episode (a context
    without a tool message) it draws how many of the episode's turns call calculate_math (0, 1 or 2; 0 with
    probability 1 - tool_call_ratio), and forces that call on those turns."""

    def __init__(self, policy_model, tokenizer, device="cpu", autocast_ctx=None, tool_call_ratio=0.5, seed=0):
        self.policy_model = policy_model
        self.tokenizer = tokenizer
        self.device = device
        self.autocast_ctx = autocast_ctx
        self.tool_call_ratio = tool_call_ratio
        self.rng = random.Random(seed)
        self.planned_calls = 0

    def _scripted_text(self, context):
        tool_messages = context.count("<|im_start|>tool")
        if tool_messages == 0:
            calls = 0 if self.rng.random() >= self.tool_call_ratio else (2 if self.rng.random() < 0.3 else 1)
            self.planned_calls = calls
        if tool_messages >= self.planned_calls:
            return None
        numbers = re.findall(r"(\d+) \+ (\d+) =", context)
        a, b = numbers[-1] if numbers else ("3", "4")
        return TOOL_CALL.format(expression=f"{a}+{b}")

    def _canonical(self, prompt_ids, context, text, ended):
        """The ids the trainer's tokenizer gives ``text`` after ``context`` (+ EOS when generation ended)."""
        ids = self.tokenizer(context + text, add_special_tokens=False)["input_ids"]
        P = prompt_ids.size(1)
        if ids[:P] != prompt_ids[0].tolist():  # the text merged into the context's last tokens: keep it apart
            ids = prompt_ids[0].tolist() + self.tokenizer(text, add_special_tokens=False)["input_ids"]
        tail = ids[P:] + ([self.tokenizer.eos_token_id] if ended else [])
        return torch.tensor([tail], dtype=torch.long, device=prompt_ids.device)

    def rollout(self, prompt_ids: Tensor, attention_mask: Tensor, num_generations: int, max_new_tokens: int, temperature: float = 0.8) -> RolloutResult:
        model = self.policy_model.module if isinstance(self.policy_model, DistributedDataParallel) else self.policy_model
        ctx = self.autocast_ctx if self.autocast_ctx else nullcontext()
        assert prompt_ids.size(0) == 1 and num_generations == 1  # rollout_single's calls
        context = self.tokenizer.decode(prompt_ids[0], skip_special_tokens=False)
        with torch.no_grad(), ctx:
            text = self._scripted_text(context)
            if text is None:
                output_ids = model.generate(
                    input_ids=prompt_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                    do_sample=True, temperature=temperature, num_return_sequences=1,
                    pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
                )
                sampled = output_ids[0, prompt_ids.size(1):]
                text = self.tokenizer.decode(sampled, skip_special_tokens=True)
                ended = bool(sampled.numel()) and sampled[-1].item() == self.tokenizer.eos_token_id
            else:
                ended = True
            completion_ids = self._canonical(prompt_ids, context, text, ended)  # [1, R]
            output_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [1, P+R]
            prompt_len = prompt_ids.size(1)
            full_mask = (output_ids != self.tokenizer.pad_token_id).long()
            per_token_logps = compute_per_token_logps(self.policy_model, output_ids, completion_ids.size(1), attention_mask=full_mask)
        completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return RolloutResult(output_ids, completion_ids, per_token_logps, completions,
                             prompt_ids.new_full((output_ids.size(0),), prompt_len),
                             attention_mask.new_ones(output_ids.size(0), completion_ids.size(1)))

    def update_policy(self, model: torch.nn.Module):
        self.policy_model = model


# ================================ 工具与 Reward = Start ================================

def rep_penalty(text, n=3, cap=0.5):
    toks = re.findall(r"\w+|[^\w\s]", text.lower())
    grams = [tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)]
    return min(cap, (len(grams) - len(set(grams))) * cap * 2 / len(grams)) if grams else 0.0


TOOLS = [
    {"type": "function", "function": {"name": "calculate_math", "description": "计算数学表达式", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
]
MOCK_RESULTS = {
    "calculate_math": lambda args: {"result": str(eval(str(args.get("expression", "0")).replace("^", "**").replace("×", "*").replace("÷", "/").replace("−", "-").replace("（", "(").replace("）", ")"), {"__builtins__": {}, "math": math}))},
}
CHECK_ARGS = {
    "calculate_math": lambda a: bool(a.get("expression")),
}


def parse_tool_calls(text):
    calls = []
    for m in re.findall(r'<tool_call>(.*?)</tool_call>', text, re.DOTALL):
        try: calls.append(json.loads(m.strip()))
        except: pass  # noqa: E722
    return calls


def execute_tool(name, args):
    fn = MOCK_RESULTS.get(name)
    if not fn: return None
    try:
        return fn(args)
    except:  # noqa: E722
        return None


# ======== 多轮 Rollout ========
def rollout_single(rollout_engine, tokenizer, messages, tools, max_turns=3, max_new_tokens=256, thinking_ratio=0.5, device="cuda"):
    all_outputs = []
    prompt_ids = None
    response_ids = []
    response_mask = []
    response_old_logps = []
    final_context = ""
    unfinished = False
    open_thinking = random.random() < thinking_ratio
    for turn in range(max_turns):
        context = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=tools, open_thinking=open_thinking)
        inputs = tokenizer(context, return_tensors="pt", add_special_tokens=False).to(device)
        context_ids = inputs["input_ids"][0].tolist()
        if prompt_ids is None:
            prompt_ids = context_ids
        rollout_result = rollout_engine.rollout(
            prompt_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            num_generations=1,
            max_new_tokens=max_new_tokens,
            temperature=0.8,
        )
        new_ids = rollout_result.completion_ids[0].tolist()
        new_logps = rollout_result.per_token_logps[0].tolist()
        if len(new_ids) != len(new_logps): Logger(f"rollout token/logprob length mismatch: {len(new_ids)} vs {len(new_logps)}")
        pairs = [(t, lp) for t, lp in zip(new_ids, new_logps) if t != tokenizer.pad_token_id and t != tokenizer.eos_token_id]
        new_ids = [t for t, _ in pairs]
        new_logps = [lp for _, lp in pairs]
        if INJECT == "turn_shift" and turn > 0:  # injected bug: a later turn's logprobs read one token late
            new_logps = new_logps[1:] + new_logps[-1:]
        new_text = rollout_result.completions[0]
        all_outputs.append(new_text)
        response_ids.extend(new_ids)
        response_mask.extend([0 if INJECT == "first_turn_only" and turn > 0 else 1] * len(new_ids))  # injected: later turns untrained
        response_old_logps.extend(new_logps)
        final_context = context + new_text
        calls = parse_tool_calls(new_text)
        if not calls:
            break
        unfinished = turn == max_turns - 1
        messages.append({"role": "assistant", "content": new_text})
        for call in calls:
            name, raw = call.get("name", ""), call.get("arguments", {})
            if isinstance(raw, str):
                try: raw = json.loads(raw)
                except: raw = {}  # noqa: E722
            result = execute_tool(name, raw)
            result_str = (json.dumps(result, ensure_ascii=False) if result else '{"error": "tool not found"}')[:2048]  # 防止天文数字撑爆tokenizer
            messages.append({"role": "tool", "content": result_str})

        observe_context = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not unfinished, tools=tools, open_thinking=open_thinking)
        observe_ids = tokenizer(observe_context, return_tensors="pt", add_special_tokens=False)["input_ids"][0].tolist()
        current_len = len(prompt_ids) + len(response_ids)
        obs_delta = observe_ids[current_len:]
        response_ids.extend(obs_delta)
        response_mask.extend([1 if INJECT == "tool_output_in_mask" else 0] * len(obs_delta))  # injected: tool result trained
        response_old_logps.extend([0.0] * len(obs_delta))
        final_context = observe_context

    final_output = all_outputs[-1] if all_outputs else ""
    prompt_ids = prompt_ids or []
    return final_output, final_context, prompt_ids, response_ids, response_mask, response_old_logps, list(all_outputs), unfinished


def rollout_batch(rollout_engine, tokenizer, messages_batch, tools_batch, num_gen, max_turns=3, max_new_tokens=256, thinking_ratio=0.5, device="cuda"):
    all_completions = []
    all_contexts = []
    all_prompt_ids = []
    all_response_ids = []
    all_response_masks = []
    all_response_old_logps = []
    all_turn_outputs = []
    all_unfinished = []
    for messages, tools in zip(messages_batch, tools_batch):
        for _ in range(num_gen):
            msgs_copy = [dict(m) for m in messages]
            completion, context, prompt_ids, response_ids, response_mask, response_old_logps, turn_outputs, unfinished = rollout_single(rollout_engine, tokenizer, msgs_copy, tools, max_turns, max_new_tokens, thinking_ratio, device)
            all_completions.append(completion)
            all_contexts.append(context)
            all_prompt_ids.append(prompt_ids)
            all_response_ids.append(response_ids)
            all_response_masks.append(response_mask)
            all_response_old_logps.append(response_old_logps)
            all_turn_outputs.append(turn_outputs)
            all_unfinished.append(unfinished)
    return all_completions, all_contexts, all_prompt_ids, all_response_ids, all_response_masks, all_response_old_logps, all_turn_outputs, all_unfinished


# ======== Reward 计算 ========
def validate_gt_in_text(text, gt_list):
    text, text_num = str(text), str(text).replace(',', '')
    nums = [float(x) for x in re.findall(r'(?<![\w.])[-+]?\d+(?:\.\d+)?(?![\w.])', text_num)]
    return {g for g in gt_list if ((s := str(g).strip()) and s.lower() in text.lower()) or (re.fullmatch(r'[-+]?\d+(?:\.\d+)?', str(g).strip().replace(',', '')) and any(abs(float(str(g).strip().replace(',', '')) - n) < 1e-6 for n in nums))}


def calculate_rewards(prompts, completions, gt_batch, tools_batch, num_gen, reward_model=None, device="cuda", turn_outputs_batch=None, unfinished_batch=None):
    rewards = torch.zeros(len(completions), device=device)
    for idx, response in enumerate(completions):
        reward, answer = 0.0, response
        sample_idx = idx // num_gen
        tools = tools_batch[sample_idx]
        turn_outputs = turn_outputs_batch[idx] if turn_outputs_batch is not None else [response]
        unfinished = unfinished_batch[idx] if unfinished_batch is not None else False
        turn_answers = [turn.split('</think>', 1)[-1].strip() if '</think>' in turn else turn.strip() for turn in turn_outputs]
        answer = turn_answers[-1] if turn_answers else response.strip()
        valid_names = {t['function']['name'] for t in tools} if tools else set()
        tool_calls = []
        for turn_answer in turn_answers: tool_calls.extend(parse_tool_calls(turn_answer))  # 解析tool调用
        reward -= 0.5 * sum(abs(turn.count('<tool_call>') - turn.count('</tool_call>')) for turn in turn_answers)  # 标签扣分
        # -------- 无工具调用：格式+reward奖励 --------
        if not tool_calls:
            reward += 0.5 if 5 <= len(response.strip()) <= 800 else -0.5  # 长度分
            if '</think>' in response:
                think, answer = response.split('</think>', 1)
                reward += 1.0 if 20 <= len(think.strip()) <= 300 else -0.5  # 思考长度分
                reward += 0.25 if response.count('</think>') == 1 else -0.25  # 思考闭合分
                answer = answer.strip()
            reward -= rep_penalty(answer)
            rewards[idx] = max(min(reward, 3.0), -3.0)  # 总分Clip
        # -------- 有工具调用：执行结果奖励 --------
        else:
            gt = gt_batch[sample_idx]
            valid_call_count = 0
            for tool_call in tool_calls:
                name, raw = tool_call.get("name", ""), tool_call.get("arguments", {})
                if isinstance(raw, str):
                    try: raw = json.loads(raw)
                    except: raw = {}  # noqa: E722
                check = CHECK_ARGS.get(name)
                valid_call_count += int(bool(name in valid_names and check and check(raw)))
            tool_gap = abs(valid_call_count - len(gt)) + max(0, len(tool_calls) - valid_call_count)  # tool数差值
            reward += 0.5 if tool_gap == 0 else -0.5 * tool_gap  # tool对齐分

            final_text = "" if unfinished else (answer.split('</tool_call>')[-1] if '</tool_call>' in answer else answer)
            verified = validate_gt_in_text(final_text, gt) if gt else set()
            if gt: reward += 2.5 * len(verified) / len(gt)  # GT分
            if unfinished: reward -= 0.5  # 未完成扣分
            reward -= rep_penalty(final_text if final_text else answer)
            rewards[idx] = max(min(reward, 3.0), -3.0)  # 总分Clip
    return rewards

# ================================ 工具与 Reward = End ================================


def dump_step(dump_dir, step, **tensors):
    """The step's tensors as the loop holds them at backward (tests compare the trace with them)."""
    from safetensors.torch import save_file
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, os.path.join(dump_dir, f"step_{step}.safetensors"))


def rl_train_epoch(epoch, loader, iters, rollout_engine, ref_model, reward_model=None, start_step=0, wandb=None, use_sglang=False):
    last_step = start_step
    for step, batch in enumerate(loader, start=start_step + 1):
        messages_batch = batch['messages']
        tools_batch = batch['tools']
        gt_batch = batch['gt']
        last_step = step

        with torch.no_grad():
            completions, contexts, prompt_ids_batch, response_ids_batch, response_masks_batch, response_old_logps_batch, turn_outputs_batch, unfinished_batch = rollout_batch(rollout_engine, tokenizer, messages_batch, tools_batch, args.num_generations, max_turns=3, max_new_tokens=args.max_gen_len, thinking_ratio=args.thinking_ratio, device=args.device)

        prompts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True, tools=t) for m, t in zip(messages_batch, tools_batch)]
        packed_samples = []
        for p, r, m, old_lp in zip(prompt_ids_batch, response_ids_batch, response_masks_batch, response_old_logps_batch):
            ids = p + r
            mask = [0] * len(p) + m
            old_logps = [0.0] * max(len(p) - 1, 0) + old_lp
            if len(ids) > args.max_total_len:
                ids = ids[-args.max_total_len:]
                mask = mask[-args.max_total_len:]
                old_logps = old_logps[-(len(ids) - 1):]
            prompt_len = next((i for i, v in enumerate(mask) if v == 1), len(mask))
            packed_samples.append((ids, mask, prompt_len, old_logps))
        seq_lens = torch.tensor([len(ids) for ids, _, _, _ in packed_samples], device=args.device)
        max_len = seq_lens.max().item()
        input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (max_len - len(ids)) for ids, _, _, _ in packed_samples], device=args.device)
        prompt_lens = torch.tensor([prompt_len for _, _, prompt_len, _ in packed_samples], device=args.device)
        full_response_masks = torch.tensor([mask + [0] * (max_len - len(mask)) for _, mask, _, _ in packed_samples], device=args.device, dtype=torch.float32)
        old_per_token_logps = torch.tensor([old_logps + [0.0] * ((max_len - 1) - len(old_logps)) for _, _, _, old_logps in packed_samples], device=args.device, dtype=torch.float32)
        full_mask = (input_ids != tokenizer.pad_token_id).long()

        rewards = calculate_rewards(prompts, completions, gt_batch, tools_batch, args.num_generations, reward_model, device=args.device, turn_outputs_batch=turn_outputs_batch, unfinished_batch=unfinished_batch)

        model_unwrapped = model.module if isinstance(model, DistributedDataParallel) else model
        with autocast_ctx:
            res = model_unwrapped(input_ids, attention_mask=full_mask)
            aux_loss = res.aux_loss if lm_config.use_moe else torch.tensor(0.0, device=args.device)
            logits = res.logits[:, :-1, :]
            per_token_logps = F.log_softmax(logits, dim=-1).gather(2, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)

        with torch.no_grad():
            ref_per_token_logps = compute_per_token_logps(ref_model, input_ids, input_ids.size(1) - 1, attention_mask=full_mask)

        completion_mask = full_response_masks[:, 1:]
        is_eos = (input_ids[:, 1:] == tokenizer.eos_token_id) & completion_mask.bool()
        eos_idx = torch.full((completion_mask.size(0),), completion_mask.size(1) - 1, device=args.device, dtype=torch.long)
        has_eos = is_eos.any(dim=1)
        eos_idx[has_eos] = is_eos.int().argmax(dim=1)[has_eos]
        pos = torch.arange(completion_mask.size(1), device=args.device).unsqueeze(0)
        completion_mask = completion_mask * (pos <= eos_idx.unsqueeze(1)).float()
        token_counts = completion_mask.sum(dim=1)
        valid_rows = token_counts > 0

        grouped_rewards = rewards.view(-1, args.num_generations)
        mean_r = grouped_rewards.mean(dim=1).repeat_interleave(args.num_generations)
        std_r = grouped_rewards.std(dim=1, unbiased=False).repeat_interleave(args.num_generations)
        advantages = (rewards - mean_r) / (std_r + 1e-4)

        kl_div = ref_per_token_logps - per_token_logps
        per_token_kl = torch.exp(kl_div) - kl_div - 1
        ratio = torch.exp(per_token_logps - old_per_token_logps)
        if args.loss_type == "cispo":
            clamped_ratio = torch.clamp(ratio, max=args.epsilon_high).detach()
            per_token_loss = -(clamped_ratio * advantages.unsqueeze(1) * per_token_logps - args.beta * per_token_kl)
        else:
            clipped_ratio = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon)
            per_token_loss1 = ratio * advantages.unsqueeze(1)
            per_token_loss2 = clipped_ratio * advantages.unsqueeze(1)
            per_token_loss = -(torch.min(per_token_loss1, per_token_loss2) - args.beta * per_token_kl)
        policy_loss = (((per_token_loss * completion_mask).sum(dim=1)[valid_rows] / token_counts[valid_rows].clamp(min=1)).mean()
                       if valid_rows.any() else per_token_loss.sum() * 0.0)
        loss = (policy_loss + aux_loss) / args.accumulation_steps
        if args.dump_dir:
            dump_step(args.dump_dir, step, input_ids=input_ids, completion_mask=completion_mask, per_token_logps=per_token_logps,
                      old_per_token_logps=old_per_token_logps, ref_per_token_logps=ref_per_token_logps, rewards=rewards,
                      advantages=advantages, prompt_lens=prompt_lens, seq_lens=seq_lens)
        loss.backward()

        if step % args.accumulation_steps == 0:
            if args.grad_clip > 0: torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

        if step % args.log_interval == 0 or step == iters:
            pl = loss.item() * args.accumulation_steps
            ar = rewards.mean().item()
            al = token_counts.float().mean().item()
            kl = ((ref_per_token_logps - per_token_logps) * completion_mask).sum().item() / max(token_counts.sum().item(), 1)
            gs = grouped_rewards.std(dim=1, unbiased=False).mean().item()
            am, ast = advantages.mean().item(), advantages.std().item()
            lr = optimizer.param_groups[0]['lr']
            Logger(f'Epoch:[{epoch+1}/{args.epochs}]({step}/{iters}), Reward:{ar:.4f}, KL:{kl:.4f}, GrpStd:{gs:.4f}, AdvStd:{ast:.4f}, Loss:{pl:.4f}, AvgLen:{al:.2f}, AdvMean:{am:.4f}, LR:{lr:.8f}')

        if step % args.save_interval == 0 or step == iters: rollout_engine.update_policy(model)

        del per_token_logps, ref_per_token_logps
        del completions, rewards, grouped_rewards, mean_r, std_r, advantages, completion_mask

    if last_step > start_step and last_step % args.accumulation_steps != 0:
        if args.grad_clip > 0: torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step(); scheduler.step(); optimizer.zero_grad()


def agent_dataset(n, seed):
    """MiniMind's AgentRLDataset rows (messages, tools, gt) for `a + b =` questions."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"messages": [{"role": "user", "content": f"{a} + {b} ="}], "tools": TOOLS, "gt": [str(a + b)]})
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="MiniMind-style Agent RL on the tiny model")
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--num_prompts", type=int, default=4, help="dataset rows (steps = num_prompts / batch_size)")
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--device", type=str, default="cpu")
    parser.add_argument("--accumulation_steps", type=int, default=1)
    parser.add_argument("--grad_clip", type=float, default=1.0)
    parser.add_argument("--log_interval", type=int, default=1)
    parser.add_argument("--save_interval", type=int, default=10)
    parser.add_argument('--use_moe', default=0, type=int, choices=[0, 1])
    parser.add_argument("--max_gen_len", type=int, default=8)
    parser.add_argument("--max_total_len", type=int, default=2500)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--loss_type", type=str, default="cispo", choices=["grpo", "cispo"])
    parser.add_argument("--epsilon", type=float, default=0.2)
    parser.add_argument("--epsilon_high", type=float, default=5.0)
    parser.add_argument("--thinking_ratio", type=float, default=0.0)
    parser.add_argument("--tool_call_ratio", type=float, default=0.5, help="episodes whose first turn calls the tool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dump_dir", type=str, default="", help="save each step's tensors here (tests)")
    parser.add_argument("--inject", default="", choices=["", "tool_output_in_mask", "first_turn_only", "turn_shift"],
                        help="a known agentic bug (tests): tool results in the loss mask, turns after the first "
                             "left untrained, a later turn's logprobs one token late")
    args = parser.parse_args()

    INJECT = args.inject
    setup_seed(42 + args.seed)
    lm_config = SimpleNamespace(use_moe=bool(args.use_moe))
    autocast_ctx = nullcontext()

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = args.max_total_len
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).to(args.device)
    model.resize_token_embeddings(len(tokenizer))
    ref_model = AutoModelForCausalLM.from_pretrained(args.model_dir).to(args.device)
    ref_model.resize_token_embeddings(len(tokenizer))
    ref_model.load_state_dict(model.state_dict())
    ref_model = ref_model.eval().requires_grad_(False)

    rollout_engine = ScriptedRolloutEngine(model, tokenizer, device=args.device, autocast_ctx=autocast_ctx,
                                           tool_call_ratio=args.tool_call_ratio, seed=args.seed)
    train_ds = agent_dataset(args.num_prompts, args.seed)
    optimizer = optim.AdamW(model.parameters(), lr=args.learning_rate)
    def collate_fn(batch): return {'messages': [b['messages'] for b in batch], 'tools': [b['tools'] for b in batch], 'gt': [b['gt'] for b in batch]}
    iters = math.ceil(len(train_ds) / args.batch_size)
    total_optimizer_steps = math.ceil(iters / args.accumulation_steps) * args.epochs
    scheduler = CosineAnnealingLR(optimizer, T_max=total_optimizer_steps, eta_min=args.learning_rate / 10)
    if args.dump_dir:
        os.makedirs(args.dump_dir, exist_ok=True)

    for epoch in range(args.epochs):
        setup_seed(42 + epoch); indices = torch.randperm(len(train_ds)).tolist()
        batch_sampler = [indices[i:i + args.batch_size] for i in range(0, len(indices), args.batch_size)]
        loader = DataLoader(train_ds, batch_sampler=batch_sampler, collate_fn=collate_fn)
        rl_train_epoch(epoch, loader, len(loader), rollout_engine, ref_model, None, 0, None)
