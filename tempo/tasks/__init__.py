"""The jobs users run: BERT pretraining, SQuAD fine-tuning and the demo, each a thin loop over tempo.train."""
