#!/usr/bin/env python3
"""Fashion-MNIST from a Spark DataFrame of PNG files, trained through pstrain.

    spark-submit --master spark://HOST:7077 fit_dataframe.py --images DIR --store DIR

DIR holds <label>/<name>.png (tests/python/spark_cluster.py's
write_fashion_mnist_pngs writes such folders from Debian's
dataset-fashion-mnist). --store is where the DataFrame is packed: a path
every executor reaches, or an s3:// prefix. Without --server the fit starts
a pstrain-server on the driver and stops it after.
"""

import argparse

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from pstrain import Sequential, layers, optimizers
from pstrain.spark import Estimator


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--server", default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save", default=None, help="where to save the fitted model")
    args = parser.parse_args()

    spark = SparkSession.builder.appName("pstrain-fit").getOrCreate()
    df = (spark.read.format("binaryFile").load(f"{args.images}/*/*.png")
          .withColumn("label", F.regexp_extract("path", r"/(\d+)/[^/]+$", 1).cast("int")))
    model = Sequential([layers.Flatten(), layers.Dense(128), layers.ReLU(), layers.Dense(10)],
                       input_shape=(1, 28, 28), name="fmnist-mlp")
    fitted = Estimator(model, server=args.server, store=args.store, features="content",
                       label="label", image_size=(28, 28), channels=1, workers=args.workers,
                       epochs=args.epochs, batch_size=32,
                       optimizer=optimizers.SGD(0.05, momentum=0.9)).fit(df)
    print(fitted.status.report())
    predictions = fitted.transform(df.limit(1000))
    accuracy = predictions.where(F.col("prediction") == F.col("label")).count() / 1000
    print(f"transform: accuracy {accuracy:.4f} on 1000 rows")
    if args.save:
        fitted.write().overwrite().save(args.save)
    spark.stop()


if __name__ == "__main__":
    main()
