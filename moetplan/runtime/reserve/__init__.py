"""The FP4 reserve of hot experts and the confidence gate that promotes a step's experts to it."""
