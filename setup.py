from setuptools import find_packages, setup

setup(
    name="spark-estimator",
    version="0.1.0",
    description="Distributed PyTorch training as a Spark ML Estimator",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["spark_estimator", "spark_estimator.*"]),
    python_requires=">=3.10",
    install_requires=[
        "pyspark>=3.5",
        "torch>=2.2",
        "pyarrow>=14",
        "pandas>=2.2,<3",
        "numpy",
        "cloudpickle>=2.2",
        "fsspec>=2023.1",
    ],
    extras_require={
        "petastorm": ["petastorm==0.13.1"],
        "test": ["pytest>=8", "pytest-timeout", "scikit-learn", "ruff"],
        "examples": ["scikit-learn"],
    },
)
