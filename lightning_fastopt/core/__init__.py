"""What every front-end (the Trainer of either Lightning package, Fabric) shares: the
strategies' arguments, the engines built for the user's optimizers, the precision core
and the loss scaler, checkpoint writing and threads."""
