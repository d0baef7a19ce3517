"""Control of a trained PRISM model: prototype sets for a behaviour, their suppression, its evaluation."""
