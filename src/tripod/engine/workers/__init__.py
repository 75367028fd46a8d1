"""PPO workers: the actor / reference (`PolicyWorker`) and critic (`CriticWorker`), each a megatron model on its
own parallel layout (`MegatronWorker`), and the `PPOBatch` they exchange."""
