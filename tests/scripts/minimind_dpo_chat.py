"""DPO written the way MiniMind's trainer/train_dpo.py is, with its dataset/lm_dataset.py DPODataset:
each side is a conversation rendered by the tokenizer's chat template (tokenize=False, then tokenized,
padded to max_length), and the loss mask keeps every assistant message from its first token through
`<|im_end|>` and the one token after it (the newline the ChatML template writes), then shifts by one
with the targets (mask[1:]). It knows nothing of tracer: tests trace it with
`python -m tracer run --algo dpo ... -- minimind_dpo_chat.py --model_dir M --data_path D`.

`--data_path`: MiniMind's dpo.jsonl format, one {"chosen": [messages], "rejected": [messages]} a line.
"""

import argparse
import copy
import json

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

# MiniMind's own loss functions, shared with the batch-only copy (sys.path[0] is this folder, as under `tracer run`)
from minimind_dpo import dpo_loss, logits_to_log_probs


class DPODataset(Dataset):
    def __init__(self, file_path, tokenizer, max_length=4096):
        super().__init__()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.padding = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.bos_id = tokenizer(f'{tokenizer.bos_token}assistant', add_special_tokens=False).input_ids
        self.eos_id = tokenizer(f'{tokenizer.eos_token}', add_special_tokens=False).input_ids
        with open(file_path, 'r', encoding='utf-8') as f:
            self.data = [json.loads(line.strip()) for line in f if line.strip()]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        item = self.data[index]
        chosen_prompt = self.tokenizer.apply_chat_template(item['chosen'], tokenize=False, add_generation_prompt=False)
        rejected_prompt = self.tokenizer.apply_chat_template(item['rejected'], tokenize=False, add_generation_prompt=False)
        chosen_encoding = self.tokenizer(chosen_prompt, truncation=True, max_length=self.max_length, padding='max_length')
        rejected_encoding = self.tokenizer(rejected_prompt, truncation=True, max_length=self.max_length,
                                           padding='max_length')
        chosen_input_ids = chosen_encoding['input_ids']
        chosen_loss_mask = self._generate_loss_mask(chosen_input_ids)
        rejected_input_ids = rejected_encoding['input_ids']
        rejected_loss_mask = self._generate_loss_mask(rejected_input_ids)
        return {
            'x_chosen': torch.tensor(chosen_input_ids[:-1], dtype=torch.long),
            'y_chosen': torch.tensor(chosen_input_ids[1:], dtype=torch.long),
            'mask_chosen': torch.tensor(chosen_loss_mask[1:], dtype=torch.long),
            'x_rejected': torch.tensor(rejected_input_ids[:-1], dtype=torch.long),
            'y_rejected': torch.tensor(rejected_input_ids[1:], dtype=torch.long),
            'mask_rejected': torch.tensor(rejected_loss_mask[1:], dtype=torch.long),
        }

    def _generate_loss_mask(self, input_ids):
        loss_mask = [0] * len(input_ids)
        i = 0
        while i < len(input_ids):
            if input_ids[i:i + len(self.bos_id)] == self.bos_id:
                start = i + len(self.bos_id)
                end = start
                while end < len(input_ids):
                    if input_ids[end:end + len(self.eos_id)] == self.eos_id:
                        break
                    end += 1
                for j in range(start + 1, min(end + len(self.eos_id) + 1, self.max_length)):
                    loss_mask[j] = 1
                i = end + len(self.eos_id) if end < len(input_ids) else len(input_ids)
            else:
                i += 1
        return loss_mask


def train_epoch(epoch, loader, iters, ref_model, beta=0.1):
    for step, batch in enumerate(loader, start=1):
        x_chosen, x_rejected = batch['x_chosen'], batch['x_rejected']
        y_chosen, y_rejected = batch['y_chosen'], batch['y_rejected']
        mask_chosen, mask_rejected = batch['mask_chosen'], batch['mask_rejected']
        x = torch.cat([x_chosen, x_rejected], dim=0)
        y = torch.cat([y_chosen, y_rejected], dim=0)
        mask = torch.cat([mask_chosen, mask_rejected], dim=0)
        with torch.no_grad():
            ref_outputs = ref_model(x)
            ref_logits = ref_outputs.logits
        ref_log_probs = logits_to_log_probs(ref_logits, y)
        outputs = model(x)
        logits = outputs.logits
        policy_log_probs = logits_to_log_probs(logits, y)
        dpo_loss_val = dpo_loss(ref_log_probs, policy_log_probs, mask, beta=beta)
        loss = dpo_loss_val
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"epoch {epoch + 1} ({step}/{iters}): dpo_loss {dpo_loss_val.item():.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="MiniMind's train_dpo.py on a chat-template model")
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--data_path", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--max_seq_len", type=int, default=64)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    train_ds = DPODataset(args.data_path, tokenizer, max_length=args.max_seq_len)
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=False)
    for epoch in range(args.epochs):
        train_epoch(epoch, loader, len(loader), ref_model, args.beta)
