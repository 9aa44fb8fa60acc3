"""The evaluation suite (`tessera evaluate`): every policy planned and simulated per section, and its report."""
